#!/usr/bin/env python3
"""Same as ``jaxcnn-eval``: ``python scripts/evaluate.py RUN_DIR [key=value ...]``."""
import sys

from jaxcnn.train.cli import eval_main

if __name__ == "__main__":
    sys.exit(eval_main())
