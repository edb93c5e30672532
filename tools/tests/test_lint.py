"""The lint of `nox -s lint`, in every test run: ruff and clang-format."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tools import ROOT


def _run(*cmd: str) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        pytest.fail(f"{cmd[0]} is not installed: the tests session installs it (tools.steps.LINT_REQS)")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)


def test_ruff_check():
    proc = _run("ruff", "check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_ruff_format():
    proc = _run("ruff", "format", "--no-cache", "--check", ".")
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_clang_format():
    sources = sorted(
        str(p)
        for ext in ("*.h", "*.cpp", "*.cu")
        for p in (ROOT / "packages").rglob(ext)
        if "build" not in p.parts and "_opscommon" not in p.parts
    )
    proc = _run("clang-format", "--dry-run", "--Werror", *sources)
    assert proc.returncode == 0, proc.stderr[-4000:]
