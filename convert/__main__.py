"""`python -m convert`: the same as `kimik3 convert` (and `python -m convert export` as `kimik3 export`)."""

import sys

from convert.cli import main

sys.exit(main())
