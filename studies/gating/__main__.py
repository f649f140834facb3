"""`python -m studies.gating`: the gating study (see the package's docstring)."""

import sys

from studies.gating.cli import main

sys.exit(main())
