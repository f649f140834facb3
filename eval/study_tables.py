"""`python -m eval.study_tables` moved to `python -m studies.gating.tables` (studies/gating/tables.py).

This alias keeps the old command working (scripts, docs and habits call it) and says where the
program went; import from studies.gating.tables instead."""

import runpy
import sys

if __name__ == "__main__":
    print("python -m eval.study_tables moved to python -m studies.gating.tables; running that",
          file=sys.stderr)
    runpy.run_module("studies.gating.tables", run_name="__main__", alter_sys=True)
