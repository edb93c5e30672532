"""Real builds through opscommon.build (setup.py in a subprocess): a CPU build
that loads, and CUDA requests that cannot be met stopping with a message
that says what to do."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import torch

EXT = Path(__file__).parent / "ext"


def _build(tmp_path: Path, **env_updates: str) -> subprocess.CompletedProcess:
    src = tmp_path / "src"
    shutil.copytree(EXT, src)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST")}
    env.update(env_updates)
    return subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib")],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _fake_cuda_home(tmp_path: Path, release: str) -> str:
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return str(home)


def test_cpu_build_writes_a_loadable_library(tmp_path):
    result = _build(tmp_path, OPS_CUDA="0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "building the CPU variant (OPS_CUDA=0" in result.stderr
    lib = tmp_path / "lib" / "opscommon_tiny"
    runtime = (lib / "_runtime.py").read_text()
    assert "'torch_min': '2.10'" in runtime and "'cuda': None" in runtime
    so = next(lib.glob("_C*.so"))
    code = (
        f"import torch; torch.ops.load_library({str(so)!r}); "
        "print(torch.ops.opscommon_tiny.axpy(torch.ones(3), torch.ones(3)).tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "[3.0, 3.0, 3.0]", out.stderr


def test_wheel_is_tagged_for_every_python(tmp_path):
    """py3-none-<platform>: the library needs no Python (loaded by path with
    torch.ops.load_library), so free-threaded CPythons install it too."""
    import platform
    import sysconfig
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(EXT, src)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST")}
    env["OPS_CUDA"] = "0"
    # setup.py itself (no pip or build frontend needed): the same bdist_wheel
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "bdist_wheel", "--dist-dir", str(tmp_path / "w")],
        cwd=src,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "w").glob("*.whl")
    assert wheel.name == f"opscommon_tiny-0.0.0-py3-none-linux_{platform.machine()}.whl"
    with zipfile.ZipFile(wheel) as zf:
        tags = [line for line in zf.read("opscommon_tiny-0.0.0.dist-info/WHEEL").decode().splitlines() if "Tag" in line]
        (so,) = [n for n in zf.namelist() if n.endswith(".so")]
    assert tags == [f"Tag: py3-none-linux_{platform.machine()}"]
    # the library's name follows the building CPython (_C.abi3.so; a
    # free-threaded one has no abi3 suffix): torch loads it by path
    assert so.startswith("opscommon_tiny/_C.")
    assert (".abi3." in so) != bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def test_cuda_requested_without_nvcc(tmp_path):
    result = _build(tmp_path, OPS_CUDA="1", CUDA_HOME=str(tmp_path / "no-cuda-here"))
    assert result.returncode != 0
    assert "OPS_CUDA=1 asks for a CUDA build" in result.stderr
    assert "nvcc was not found (set CUDA_HOME" in result.stderr
    assert "Set OPS_CUDA=0 to build the CPU variant instead" in result.stderr


def test_cuda_requested_with_mismatched_major(tmp_path):
    result = _build(tmp_path, OPS_CUDA="1", CUDA_HOME=_fake_cuda_home(tmp_path, "11.8"))
    assert result.returncode != 0
    if torch.version.cuda is None:
        assert "the installed torch is a CPU-only build" in result.stderr
    else:
        assert f"nvcc is CUDA 11.8 but torch was built with CUDA {torch.version.cuda}" in result.stderr


def test_cuda_requested_with_malformed_arch_list(tmp_path):
    result = _build(tmp_path, OPS_CUDA="1", TORCH_CUDA_ARCH_LIST="sm_90;banana")
    assert result.returncode != 0
    assert "TORCH_CUDA_ARCH_LIST='sm_90;banana' is malformed (bad entries: sm_90, banana)" in result.stderr


def test_auto_with_a_wrong_arch_list_fails_instead_of_building_the_cpu_variant(tmp_path):
    result = _build(tmp_path, OPS_CUDA="auto", TORCH_CUDA_ARCH_LIST="Ampere+PTX")
    assert result.returncode != 0
    assert "TORCH_CUDA_ARCH_LIST='Ampere+PTX' is malformed" in result.stderr
    assert "Set OPS_CUDA=0" in result.stderr or "set OPS_CUDA=0" in result.stderr
    assert "building the CPU variant" not in result.stderr
