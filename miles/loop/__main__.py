"""`python -m miles.loop --run-dir RUN_DIR [--resume]`: the RL loop on one trainer rank (driver.py)."""

import sys

from miles.loop.driver import main

sys.exit(main())
