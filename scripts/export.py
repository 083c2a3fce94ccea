#!/usr/bin/env python3
"""Same as ``jaxcnn-export``: ``python scripts/export.py runs/mnist_cnn --format onnx --out m.onnx``."""
import sys

from jaxcnn._console import export

if __name__ == "__main__":
    sys.exit(export())
