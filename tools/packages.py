"""The packages of packages/: which are op packages, their names and versions."""

from __future__ import annotations

import re
from pathlib import Path

from . import ROOT

PACKAGES = ROOT / "packages"
COMMON = "opscommon"  # the build-time package every op builds on


def op_packages(root: Path = PACKAGES) -> list[str]:
    """Folders of packages/ that build an op (have a setup.py), sorted."""
    return sorted(p.name for p in root.iterdir() if (p / "setup.py").is_file() and p.name != COMMON)


def import_name(package: str) -> str:
    """``lltm-op`` -> ``lltm_op``."""
    return package.replace("-", "_")


def version(package: str, root: Path = PACKAGES) -> str:
    """The version in a package's own pyproject.toml."""
    text = (root / package / "pyproject.toml").read_text()
    m = re.search(r'^version = "([^"]+)"', text, re.M)
    if not m:
        raise ValueError(f"packages/{package}/pyproject.toml has no version")
    return m.group(1)
