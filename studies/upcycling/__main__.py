"""`python -m studies.upcycling`: the upcycling runs (see studies/upcycling/runs.py)."""

import sys

from studies.upcycling.runs import main

sys.exit(main())
