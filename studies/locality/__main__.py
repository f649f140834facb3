"""`python -m studies.locality profile|sweep|predictors` (see the package's docstring)."""

import sys

from studies.locality.cli import main

sys.exit(main())
