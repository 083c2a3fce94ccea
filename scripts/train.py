#!/usr/bin/env python3
"""Same as ``jaxcnn-train``: ``python scripts/train.py configs/mnist_cnn.yaml [key=value ...]``."""
import sys

from jaxcnn._console import train

if __name__ == "__main__":
    sys.exit(train())
