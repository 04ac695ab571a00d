"""`python train.py ...` is `raymcn train ...` (see README)."""

import sys

from raymcn.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
