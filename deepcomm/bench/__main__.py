import sys

from deepcomm.bench.cli import main

# The guard matters: spawned worker processes re-import this module as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
