"""``python -m raymcn ...``: the ``raymcn`` command, for a shell where the venv's scripts are not on
the PATH."""

import sys

from raymcn.cli import main

sys.exit(main())
