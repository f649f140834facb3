"""python -m egmla.kernels {build,status}: compile the CPU kernels, or say whether they are used."""

from __future__ import annotations

import argparse
import json
import sys

from egmla import kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m egmla.kernels", description=__doc__)
    parser.add_argument("command", choices=["build", "status"],
                        help="build: compile now (again with --force); status: print, as JSON, "
                             "whether the kernels are loaded, and if not why")
    parser.add_argument("--force", action="store_true", help="rebuild even if built")
    args = parser.parse_args(argv)
    if args.command == "build":
        reason = kernels.unsupported()
        if reason:
            print(f"egmla.kernels: not built: {reason}; PyTorch's kernels are used")
            return 0
        try:
            path = kernels.build(force=args.force)
        except kernels.KernelBuildError as error:
            print(f"egmla.kernels: build failed; PyTorch's kernels will be used:\n{error}",
                  file=sys.stderr)
            return 1
        print(f"egmla.kernels: built {path}")
        return 0
    print(json.dumps(kernels.status(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
