"""`python -m deepcomm`: the diagnosis of this machine (deepcomm/diagnose.py)."""
import sys

from .diagnose import main

sys.exit(main())
