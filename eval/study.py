"""`python -m eval.study` moved to `python -m studies.gating` (studies/gating/).

This alias keeps the old command working (scripts, docs and habits call it) and says where the
program went; import from studies.gating instead."""

import runpy
import sys

if __name__ == "__main__":
    print("python -m eval.study moved to python -m studies.gating; running that",
          file=sys.stderr)
    runpy.run_module("studies.gating", run_name="__main__", alter_sys=True)
