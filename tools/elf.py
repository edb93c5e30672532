"""Symbol versions an ELF shared object needs (glibc, libstdc++, libgcc),
and whether it needs Python.

Reads ``objdump -T`` / ``objdump -p`` (any CPU's ELF); used by the wheel
checks and the conda chain to compare a binary against the glibc floor it
declares, and to hold a ``py3-none`` wheel to its promise: no Python C API.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

_VERSION_RE = re.compile(r"\b(GLIBC|GLIBCXX|CXXABI|GCC)_(\d+(?:\.\d+)*)\b")


# ELF e_machine values of the CPUs the wheels are built for.
_MACHINES = {62: "x86_64", 183: "aarch64"}


def machine(path: Path) -> str:
    """The CPU an ELF file is for ("x86_64", "aarch64"; "EM_<n>" for others),
    read from its header (any architecture, no tool needed)."""
    with open(path, "rb") as fh:
        head = fh.read(20)
    if head[:4] != b"\x7fELF":
        raise ValueError(f"{path} is not an ELF file")
    order = "little" if head[5] == 1 else "big"
    em = int.from_bytes(head[18:20], order)
    return _MACHINES.get(em, f"EM_{em}")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def required_versions(path: Path) -> dict[str, list[str]]:
    """{"GLIBC": ["2.2.5", "2.14"], "GLIBCXX": [...], ...} of the undefined
    (imported) symbols of ``path``, each list sorted."""
    out = _objdump("-T", path)
    found: dict[str, set[str]] = {}
    for line in out.splitlines():
        if "*UND*" not in line:
            continue
        for name, ver in _VERSION_RE.findall(line):
            found.setdefault(name, set()).add(ver)
    return {name: sorted(vers, key=_key) for name, vers in sorted(found.items())}


def _objdump(flag: str, path: Path) -> str:
    return subprocess.run(["objdump", flag, str(path)], capture_output=True, text=True, check=True).stdout


# Every symbol of the Python C API (and its private part) starts so.
_PYTHON_SYMBOL = re.compile(r"^_?Py[A-Z_]")


def python_imports(path: Path) -> list[str]:
    """What ``path`` needs of a Python interpreter: its undefined symbols of
    the Python C API (``PyLong_FromLong``, ``_Py_Dealloc``...) and any
    ``libpython`` it names as needed. Empty for a library that runs in every
    CPython, free-threaded or not, and without one."""
    found = []
    for line in _objdump("-T", path).splitlines():
        fields = line.split()
        if "*UND*" in fields and fields and _PYTHON_SYMBOL.match(fields[-1]):
            found.append(fields[-1])
    for line in _objdump("-p", path).splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == "NEEDED" and fields[1].startswith("libpython"):
            found.append(fields[1])
    return sorted(set(found))


def highest(path: Path) -> dict[str, str]:
    """The highest version of each family ``path`` needs: {"GLIBC": "2.17", ...}."""
    return {name: vers[-1] for name, vers in required_versions(path).items()}


def exceeds(path: Path, floor: dict[str, str]) -> list[str]:
    """Versions ``path`` needs above ``floor`` ({"GLIBC": "2.28", ...}), as
    "GLIBC_2.32" strings; empty when the binary keeps to the floor."""
    over = []
    for name, vers in required_versions(path).items():
        limit = floor.get(name)
        if limit is None:
            continue
        over += [f"{name}_{v}" for v in vers if _key(v) > _key(limit)]
    return over


# The manylinux_2_28 policy (PEP 600; auditwheel's policy file): glibc 2.28
# and the libstdc++/libgcc of GCC 8 that RHEL 8 ships.
MANYLINUX_2_28 = {"GLIBC": "2.28", "GLIBCXX": "3.4.25", "CXXABI": "1.3.11", "GCC": "8.0.0"}
