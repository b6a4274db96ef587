"""`python -m tokenrouter.planner ...` = `tokenrouter plan ...`."""

import sys

from tokenrouter.planner.cli import main

sys.exit(main())
