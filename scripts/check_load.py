"""Check that an installed op package loads (or refuses to load) as it should
in the torch of this environment. Needs no GPU.

    python scripts/check_load.py IMPORT_NAME --expect cuda|refused|cpu [--json FILE]

``cuda``: the package imports, and every op in its namespace has a CPU kernel
and a CUDA kernel registered by the compiled library (not the Python stub a
CPU build installs for CUDA tensors). ``refused``: importing raises a clear
ImportError (a CUDA build in a CPU torch or one of another CUDA major).
``cpu``: the package imports and every op has a compiled CPU kernel.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

import torch

_LINE = re.compile(r"^(\w+): registered at (.*?)(?: :: |$)", re.M)


def kernels(op: str) -> dict[str, str]:
    """dispatch key -> where its kernel was registered."""
    return dict(_LINE.findall(torch._C._dispatch_dump(op)))


def check(name: str, expect: str) -> tuple[str, str]:
    torch_desc = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
    try:
        mod = importlib.import_module(name)
    except ImportError as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        if expect == "refused":
            return "pass", f"refused as it should in {torch_desc}: {message}"
        return "fail", f"import failed in {torch_desc}: {message}"
    if expect == "refused":
        return "fail", f"loaded in {torch_desc} although its build cannot run there"
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(f"{name}::"))
    if not ops:
        return "fail", f"imported, but no operator is registered in namespace {name}::"
    problems = []
    for op in ops:
        k = kernels(op)
        for key in ("CPU", "CUDA") if expect == "cuda" else ("CPU",):
            where = k.get(key)
            if where is None:
                problems.append(f"{op} has no {key} kernel")
            elif where.split(":")[0].endswith(".py"):
                problems.append(f"{op}: the {key} kernel is a Python stub ({where})")
    if problems:
        return "fail", "; ".join(problems)
    build = getattr(getattr(mod, "_runtime", None), "BUILD_INFO", {})
    keys = "CPU+CUDA" if expect == "cuda" else "CPU"
    return "pass", (
        f"loaded in {torch_desc}; {keys} kernels of {len(ops)} op(s) registered "
        f"(built with torch {build.get('torch_built_with', '?')}, CUDA {build.get('cuda')})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("package")
    parser.add_argument("--expect", choices=["cuda", "refused", "cpu"], required=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    status, detail = check(args.package, args.expect)
    print(f"check_load {args.package}: {status}: {detail}")
    if args.json:
        args.json.write_text(json.dumps({"status": status, "detail": detail}))
    return 0 if status == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
