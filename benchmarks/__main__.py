"""`python -m benchmarks NAME [options]` from the repository root: `rft bench NAME [options]`."""
import sys

from benchmarks.main import main

sys.exit(main(sys.argv[1:]))
