"""`python -m miles`: the `miles` command (miles/cli.py), for hosts where the console script is not on PATH."""

import sys

from miles.cli import main

if __name__ == "__main__":
    sys.exit(main())
