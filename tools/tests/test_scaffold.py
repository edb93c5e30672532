"""`nox -s new_op -- NAME` in a temporary copy of the repository: the new
package is found by the sessions, builds, and passes the shared contract
with no other file edited."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools import ROOT, scaffold
from tools.packages import op_packages


def _copy_repository(dest: Path) -> Path:
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.mark.parametrize("name", ["op", "My-op", "my_op", "myop-", "round-op"])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError):
        scaffold.new_op(name)


def test_rename_changes_every_form_of_the_name():
    assert scaffold.rename("round-op round_op ROUND_OP_HOST", "spin-op") == "spin-op spin_op SPIN_OP_HOST"


@pytest.fixture(scope="module")
def new_repo(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to copy")
    repo = _copy_repository(tmp_path_factory.mktemp("repo"))
    subprocess.run([sys.executable, "-m", "tools.scaffold", "spin-op"], cwd=repo, check=True)
    return repo


def test_new_op_is_discovered_with_its_recipe(new_repo):
    assert "spin-op" in op_packages(new_repo / "packages")
    pkg = new_repo / "packages" / "spin-op"
    assert (pkg / "src" / "spin_op" / "ops.py").is_file() and (pkg / "LICENSE").is_file()
    assert not any(
        "round_op" in p.read_text() or "round-op" in p.read_text()
        for p in pkg.rglob("*")
        if p.is_file() and p.suffix in (".py", ".cpp", ".cu", ".h", ".toml")
    )
    assert not (pkg / "bench" / "results-h200").exists()
    assert (new_repo / "recipes" / "spin-op" / "recipe.yaml").is_file()
    subprocess.run([sys.executable, "-m", "tools.recipes", "--check"], cwd=new_repo, check=True)


def test_new_op_builds_and_passes_the_contract(new_repo, tmp_path):
    """What `nox -s tests-3.11 -- spin-op` does, in this environment: build
    the wheel against its torch (no isolation), then the package's tests."""
    pytest.importorskip("torch")
    pytest.importorskip("build")
    out = tmp_path / "wheel"
    env = {**os.environ, "OPS_CUDA": "0"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(out),
            str(new_repo / "packages" / "spin-op"),
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    (wheel,) = out.glob("spin_op-0.1.0-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-x",
            str(new_repo / "packages" / "spin-op" / "tests"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1]
