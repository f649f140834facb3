"""`python -m eval.locality_runs` moved to `python -m studies.locality.runs` (studies/locality/runs.py).

This alias keeps the old command working (scripts, docs and habits call it) and says where the
program went; import from studies.locality.runs instead."""

import runpy
import sys

if __name__ == "__main__":
    print("python -m eval.locality_runs moved to python -m studies.locality.runs; running that",
          file=sys.stderr)
    runpy.run_module("studies.locality.runs", run_name="__main__", alter_sys=True)
