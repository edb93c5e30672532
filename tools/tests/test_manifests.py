"""Every op package's sdist carries the sources its build compiles: each
file under csrc/ is matched by a `recursive-include csrc` pattern of its
MANIFEST.in (an sdist without a header builds nowhere)."""

from __future__ import annotations

import fnmatch

import pytest

from tools.packages import PACKAGES, op_packages


def _csrc_patterns(manifest: str) -> list[str]:
    patterns = []
    for line in manifest.splitlines():
        words = line.split()
        if words[:2] == ["recursive-include", "csrc"]:
            patterns += words[2:]
    return patterns


@pytest.mark.parametrize("package", op_packages())
def test_manifest_carries_every_source(package):
    root = PACKAGES / package
    patterns = _csrc_patterns((root / "MANIFEST.in").read_text())
    sources = [p for p in (root / "csrc").rglob("*") if p.is_file()]
    assert sources, f"{package}: no sources under csrc/"
    missing = [str(p.relative_to(root)) for p in sources if not any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    assert not missing, f"{package}: MANIFEST.in leaves out {missing}"
