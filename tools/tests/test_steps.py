"""Session steps that need no session: arguments, uv configuration, suites."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from tools import steps
from tools.packages import import_name, op_packages, version


def test_op_packages_are_the_folders_with_a_setup_py():
    ops = op_packages()
    assert "opscommon" not in ops and ops == sorted(ops)
    assert {"round-op", "vecadd-op", "lltm-op"} <= set(ops)
    assert import_name("lltm-op") == "lltm_op"
    assert all(version(p).count(".") == 2 for p in ops)


def test_parse_args_splits_packages_flags_and_pytest_options():
    a = steps.parse_args(["round_op", "-k", "gradcheck", "--no-cuda-compile"], {"--no-cuda-compile"})
    assert a.packages == ["round-op"] and a.suites == ["round-op"]
    assert a.rest == ["-k", "gradcheck"] and a.flags == {"--no-cuda-compile"}


def test_parse_args_defaults_and_integration():
    assert steps.parse_args([]).packages == op_packages() and steps.parse_args([]).suites is None
    a = steps.parse_args(["integration"])
    assert a.packages == op_packages() and a.suites == ["integration"]
    assert steps.parse_args(["tools"]).packages == []


def test_parse_args_refuses_a_folder_without_setup_py(tmp_path):
    (tmp_path / "half-op").mkdir()
    with pytest.raises(ValueError, match="packages/half-op has no setup.py"):
        steps.parse_args(["half-op"], root=tmp_path)


def test_uv_reads_pip_configuration():
    env = steps.uv_env_from_pip(
        {"find-links": ["/opt/wheels"], "extra-index-url": ["file:///a", "file:///b"], "constraint": ["/etc/c.txt"]}
    )
    assert env == {
        "UV_EXTRA_INDEX_URL": "file:///a file:///b",
        "UV_FIND_LINKS": "/opt/wheels",
        "UV_INDEX_STRATEGY": "unsafe-best-match",
        "UV_CONSTRAINT": "/etc/c.txt",
    }
    assert steps.uv_env_from_pip({}) == {}


def test_suites_order_and_choice():
    names = [name for name, _ in steps.test_suites(op_packages(), None)]
    assert names[:2] == ["tools", "opscommon"] and names[-1] == "integration"
    assert [n for n, _ in steps.test_suites(["round-op"], ["round-op"])] == ["round-op"]


def test_junit_counts(tmp_path):
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="1" skipped="2"/></testsuites>'
    )
    assert steps.junit_counts(tmp_path / "j.xml") == {"passed": 1, "failed": 2, "skipped": 2}
    assert steps.junit_counts(tmp_path / "missing.xml") == {"passed": 0, "failed": 0, "skipped": 0}


def test_pip_platforms_accept_every_older_manylinux():
    args = steps.pip_platforms("manylinux_2_28_aarch64")
    names = args[1::2]
    assert set(args[0::2]) == {"--platform"}
    # NVIDIA's aarch64 wheels are tagged manylinux_2_27 / 2_17 / 2014: all accepted
    for tag in ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"):
        assert tag in names
    assert not any(n.endswith("x86_64") or "2_29" in n for n in names)
    assert steps.pip_platforms("win_amd64") == ["--platform", "win_amd64"]


def test_cross_build_env_names_compiler_target_torch_and_platform(tmp_path):
    from tools import matrix

    arm = matrix.load().platforms["aarch64"]
    env = steps.cross_build_env(arm, tmp_path)
    assert env["OPS_CROSS_TORCH"] == str(tmp_path) and env["OPS_CROSS_PLAT"] == "linux_aarch64"
    assert env["CXX"] == "aarch64-linux-gnu-g++" and env["LDSHARED"].startswith("aarch64-linux-gnu-g++ ")
    missing = steps.cross_compiler_missing(matrix.Platform("x", "manylinux_2_28_x", False, "", ("cpu",), "nosuch-"))
    assert missing and "nosuch-g++ is not installed" in missing


class _TmpSession:
    """What steps.cross_cuda_home asks of a session when its files are cached."""

    def __init__(self, root):
        self.root = root

    def create_tmp(self):
        return str(self.root)

    def log(self, text):
        pass


def _seed_target_files(cache, tk, plat, libs=("libcudart.so.13",)):
    files = cache / f"cuda-{tk.version}-{plat.wheel_tag}"
    (files / "include" / "crt").mkdir(parents=True)
    (files / "include" / "cuda_runtime.h").write_text("// target\n")
    (files / "lib").mkdir()
    for lib in libs:
        (files / "lib" / lib).write_bytes(b"")
    (files / ".complete").write_text("seeded\n")
    return files


def test_cross_cuda_home_runs_the_host_toolkit_on_the_target_files(tmp_path, monkeypatch):
    from tools import matrix

    m = matrix.load()
    arm, tk = m.platforms["aarch64"], m.toolkits["13.0"]
    monkeypatch.setattr(steps, "CACHE", tmp_path / "cache")
    files = _seed_target_files(tmp_path / "cache", tk, arm)
    host = tmp_path / "host"
    (host / "bin").mkdir(parents=True)
    (host / "nvvm" / "bin").mkdir(parents=True)
    for tool in ("nvcc", "nvcc.profile", "ptxas"):
        (host / "bin" / tool).write_text(tool)
    with pytest.raises(ValueError, match="not the nvcc program itself"):  # e.g. a wrapper script
        steps.cross_cuda_home(_TmpSession(tmp_path / "tmp0"), tk, arm, host)
    (host / "bin" / "nvcc").write_bytes(b"\x7fELF" + bytes(60))
    home = steps.cross_cuda_home(_TmpSession(tmp_path / "tmp"), tk, arm, host)
    # nvcc's own folder is home/bin (a real folder), so it finds targets/ under home
    assert (home / "bin").is_dir() and not (home / "bin").is_symlink()
    assert (home / "bin" / "nvcc").resolve() == (host / "bin" / "nvcc").resolve()
    assert (home / "nvvm" / "bin").is_dir()
    for where in ("", "targets/aarch64-linux/", "targets/sbsa-linux/"):
        assert (home / where / "include" / "cuda_runtime.h").read_text() == "// target\n"
        assert (home / where / "lib" / "libcudart.so").resolve() == (files / "lib" / "libcudart.so.13").resolve()
    with pytest.raises(ValueError, match="target files come from PyPI"):
        steps.cross_cuda_home(_TmpSession(tmp_path / "tmp2"), m.toolkits["12.4"], arm, host)


def _is_elf(path: Path) -> bool:
    try:
        return path.read_bytes()[:4] == b"\x7fELF"
    except OSError:
        return False


def test_cross_cuda_home_compiles_cuda_for_aarch64(tmp_path):
    """nvcc of this machine with the aarch64 g++ as host compiler, against the
    aarch64 CUDA files `nox -s build -- aarch64 cuda` fetched: an aarch64
    object with the device code embedded."""
    import shutil
    import subprocess

    from tools import elf, matrix, toolkits

    m = matrix.load()
    arm, tk = m.platforms["aarch64"], m.toolkits["13.0"]
    files = steps.CACHE / f"cuda-{tk.version}-{arm.wheel_tag}"
    # a toolkit whose nvcc is the program itself (not a wrapper script elsewhere):
    # this environment's PyPI one (tests-3.11 installs it), CUDA_HOME's, a system one
    candidates = [
        toolkits.locate(tk, Path(sysconfig.get_paths()["purelib"]))[0],
        toolkits.from_cuda_home(tk.version),
        Path(f"/usr/local/cuda-{tk.version}"),
        toolkits.find_system_toolkit(tk.version)[0],
    ]
    host = next((h for h in candidates if h is not None and _is_elf(h / "bin" / "nvcc")), None)
    if shutil.which("aarch64-linux-gnu-g++") is None or host is None or not (files / ".complete").is_file():
        pytest.skip("needs aarch64-linux-gnu-g++, a CUDA 13.0 nvcc and `nox -s build -- aarch64 cuda` run once")
    home = steps.cross_cuda_home(_TmpSession(tmp_path / "tmp"), tk, arm, host)
    (tmp_path / "k.cu").write_text(
        "#include <cuda_runtime.h>\n__global__ void k(float* a) { a[threadIdx.x] += 1.0f; }\n"
        'extern "C" int go(float* a) { k<<<1, 32>>>(a); return (int)cudaGetLastError(); }\n'
    )
    obj = tmp_path / "k.o"
    subprocess.run(
        [str(home / "bin" / "nvcc"), "-ccbin", "aarch64-linux-gnu-g++", "-Xcompiler", "-fPIC", "-arch=sm_90"]
        + ["-c", str(tmp_path / "k.cu"), "-o", str(obj)],
        check=True,
    )
    assert elf.machine(obj) == "aarch64"
    sections = subprocess.run(["objdump", "-h", str(obj)], capture_output=True, text=True).stdout
    assert ".nv_fatbin" in sections
