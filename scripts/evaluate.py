#!/usr/bin/env python3
"""Same as ``jaxcnn-eval``: ``python scripts/evaluate.py RUN_DIR [key=value ...]``."""
import sys

from jaxcnn._console import evaluate

if __name__ == "__main__":
    sys.exit(evaluate())
