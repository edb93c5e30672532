"""The C++ runner of AOTInductor packages (opscommon/aoti_runner): built with
its CMakeLists.txt as the top-level README says, and its errors. The op
packages' tests/test_deploy_<op>.py run real packages through it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from opscommon import deploy


def _run(*cmd) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def runner() -> Path:
    if not deploy.cxx_available():
        pytest.skip("needs a C++ compiler")
    return deploy.build_runner()


def test_runner_argument_errors(runner, tmp_path):
    proc = _run(runner, "--package", "model.pt2")
    assert proc.returncode == 2 and "--package, --inputs and --outputs are required" in proc.stderr
    proc = _run(runner, "--frobnicate", "1")
    assert proc.returncode == 2 and "unknown argument --frobnicate" in proc.stderr
    missing = tmp_path / "libmissing.so"
    proc = _run(runner, "--library", missing, "--package", "m.pt2", "--inputs", "i.pt", "--outputs", "o.pt")
    assert proc.returncode == 1 and f"cannot load op library {missing}" in proc.stderr


def test_runner_reports_a_bad_package_without_a_backtrace(runner, tmp_path):
    torch.save([torch.zeros(2)], tmp_path / "in.pt")
    (tmp_path / "model.pt2").write_bytes(b"not a package")
    proc = _run(runner, "--package", tmp_path / "model.pt2", "--inputs", tmp_path / "in.pt", "--outputs", "o.pt")
    assert proc.returncode == 1 and proc.stderr.startswith("aoti_runner: "), proc.stderr
    assert "frame #" not in proc.stderr  # torch's message, not its C++ backtrace


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_cmake_builds_the_runner(tmp_path):
    """The README's CMake commands: find_package(Torch) of the wheel, and
    torch's lib folder in the program's run path (found without
    LD_LIBRARY_PATH)."""
    build = tmp_path / "build"
    configure = ["cmake", "-S", deploy.RUNNER_DIR, "-B", build, f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"]
    for cmd in (configure, ["cmake", "--build", build]):
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run(
        [str(build / "aoti_runner"), "--package", "m.pt2"], capture_output=True, text=True, env={}, timeout=60
    )
    assert proc.returncode == 2 and "usage: aoti_runner" in proc.stderr, proc.stderr
