"""`python -m lltm_op --library-path`: print the path of this package's compiled
library, the file a C++ program loads (dlopen) to register the package's ops
with torch's dispatcher; it needs no Python, only torch's libraries."""

from __future__ import annotations

import argparse
import glob
import os
import sys


def library_path() -> str:
    """The compiled library (``_C*.so``) of this package."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_C*.so")))
    if not found:
        sys.exit(f"lltm_op: compiled library _C*.so not found in {here}")
    return found[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lltm_op", description=__doc__)
    parser.add_argument("--library-path", action="store_true", help="print the compiled library's path")
    args = parser.parse_args(argv)
    if not args.library_path:
        parser.print_help()
        return
    print(library_path())


if __name__ == "__main__":
    main()
