"""`python -m rft.cli ...`: the `rft` command, for child processes started with this interpreter."""
import sys

from rft.cli import main

sys.exit(main())
