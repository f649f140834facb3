"""`python -m eval.locality` moved to `python -m studies.locality` (studies/locality/).

This alias keeps the old command working (scripts, docs and habits call it) and says where the
program went; import from studies.locality instead."""

import runpy
import sys

if __name__ == "__main__":
    print("python -m eval.locality moved to python -m studies.locality; running that",
          file=sys.stderr)
    runpy.run_module("studies.locality", run_name="__main__", alter_sys=True)
