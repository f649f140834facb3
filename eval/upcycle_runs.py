"""`python -m eval.upcycle_runs` moved to `python -m studies.upcycling` (studies/upcycling/).

This alias keeps the old command working (scripts, docs and habits call it) and says where the
program went; import from studies.upcycling instead."""

import runpy
import sys

if __name__ == "__main__":
    print("python -m eval.upcycle_runs moved to python -m studies.upcycling; running that",
          file=sys.stderr)
    runpy.run_module("studies.upcycling", run_name="__main__", alter_sys=True)
