"""Symbol versions of real binaries, and the per-variant PEP 503 index."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tools import elf, wheels
from tools.packages import COMMON, PACKAGES

COMPAT = PACKAGES / COMMON / "src" / "opscommon" / "include" / "opscommon" / "glibc_compat"
SOURCE = """
#include <cmath>
#include <memory>
#include <sstream>
#include <dlfcn.h>
extern "C" double f(double x) {
  if (dlsym(RTLD_DEFAULT, "f") == nullptr) return 0;  // as torch >= 2.14's stable headers do
  auto p = std::make_shared<int>(3);
  std::ostringstream s; s << x;
  return std::exp(x) + std::log(x) + std::pow(x, 1.5) + *p + s.str().size();
}
"""
needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("objdump") is None, reason="needs g++ and objdump"
)


CROSS_GXX = "aarch64-linux-gnu-g++"
needs_cross = pytest.mark.skipif(
    shutil.which(CROSS_GXX) is None or shutil.which("objdump") is None,
    reason=f"needs {CROSS_GXX} (apt-get install g++-aarch64-linux-gnu) and objdump",
)


def _build(tmp_path, flags, gxx="g++"):
    (tmp_path / "t.cpp").write_text(SOURCE)
    out = tmp_path / f"t{len(flags)}.so"
    subprocess.run(
        [gxx, "-O2", "-shared", "-fPIC", "-std=c++17", *flags, str(tmp_path / "t.cpp"), "-o", str(out)], check=True
    )
    return out


@needs_gxx
def test_compat_headers_keep_a_binary_at_glibc_2_28(tmp_path):
    compat = ["-isystem", str(COMPAT), "-include", str(COMPAT / "opscommon_glibc_compat.h")]
    so = _build(tmp_path, compat)
    assert elf.exceeds(so, elf.MANYLINUX_2_28) == []
    assert "GLIBC" in elf.highest(so)


@needs_gxx
def test_floor_check_reads_what_a_plain_build_needs(tmp_path):
    so = _build(tmp_path, [])
    glibc = tuple(int(x) for x in elf.highest(so)["GLIBC"].split("."))
    over = elf.exceeds(so, {"GLIBC": "2.2.5"})
    assert over and all(v.startswith("GLIBC_") for v in over)
    assert elf.exceeds(so, {"GLIBC": ".".join(map(str, glibc))}) == []


@needs_cross
def test_compat_headers_keep_an_aarch64_binary_at_its_first_glibc(tmp_path):
    compat = ["-isystem", str(COMPAT), "-include", str(COMPAT / "opscommon_glibc_compat.h")]
    so = _build(tmp_path, compat, CROSS_GXX)
    assert elf.machine(so) == "aarch64"
    # every glibc symbol at aarch64's first version (Debian 12's cross glibc is 2.36)
    assert elf.required_versions(so)["GLIBC"] == ["2.17"]
    (tmp_path / "plain").mkdir()
    plain = _build(tmp_path / "plain", [], CROSS_GXX)
    assert elf.exceeds(plain, elf.MANYLINUX_2_28), "a plain build should need a newer glibc (exp, dlsym)"


PYTHON_USER = """
#include <Python.h>
extern "C" PyObject* boxed(long x) { return PyLong_FromLong(x); }
"""


def _python_user(tmp_path, gxx="g++", extra=()):
    import sysconfig

    (tmp_path / "p.cpp").write_text(PYTHON_USER)
    out = tmp_path / "p.so"
    cmd = [gxx, "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"], str(tmp_path / "p.cpp"), "-o", str(out)]
    subprocess.run([*cmd, *extra], check=True)
    return out


@needs_gxx
def test_python_imports_finds_the_python_c_api_and_libpython(tmp_path):
    """What makes a py3-none wheel a lie: a Python C API symbol, or libpython."""
    assert elf.python_imports(_build(tmp_path, [])) == []  # C++ and libc only
    assert elf.python_imports(_python_user(tmp_path)) == ["PyLong_FromLong"]
    # a library linked to a libpython (a stand-in: its NEEDED entry is what counts)
    fake = tmp_path / "libpython3.99.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-x", "c++", "/dev/null", "-o", str(fake)], check=True)
    linked = _python_user(tmp_path, extra=["-Wl,--no-as-needed", "-L", str(tmp_path), "-lpython3.99"])
    assert elf.python_imports(linked) == ["PyLong_FromLong", "libpython3.99.so"]


@needs_cross
def test_python_imports_reads_an_aarch64_binary(tmp_path):
    assert elf.python_imports(_python_user(tmp_path, CROSS_GXX)) == ["PyLong_FromLong"]


def test_wheel_tag_of_a_file_name():
    assert wheels.wheel_tag("lltm_op-0.4.0+cu130-py3-none-manylinux_2_28_x86_64.whl") == (
        "py3-none-manylinux_2_28_x86_64"
    )
    assert wheels.wheel_tag(Path("/d/round_op-0.4.0-1-cp310-abi3-linux_aarch64.whl")) == "cp310-abi3-linux_aarch64"
    with pytest.raises(ValueError, match="not a wheel"):
        wheels.wheel_tag("round_op-0.4.0.tar.gz")


def test_elf_machine_reads_the_header(tmp_path):
    import platform
    import sys

    assert elf.machine(Path(sys.executable).resolve()) == platform.machine()
    fake = tmp_path / "x.so"
    fake.write_bytes(b"\x7fELF\x02\x01\x01" + bytes(11) + (183).to_bytes(2, "little") + bytes(40))
    assert elf.machine(fake) == "aarch64"
    (tmp_path / "t.txt").write_text("no elf")
    with pytest.raises(ValueError, match="not an ELF"):
        elf.machine(tmp_path / "t.txt")


def test_machine_of_a_platform_tag():
    assert wheels.machine_of("manylinux_2_28_aarch64") == "aarch64"
    assert wheels.machine_of("manylinux_2_28_x86_64") == "x86_64"


def test_index_is_pep_503(tmp_path):
    for name in (
        "lltm_op-0.1.0+cu130-py3-none-manylinux_2_28_x86_64.whl",
        "round_op-0.1.0+cu130-py3-none-manylinux_2_28_x86_64.whl",
    ):
        with zipfile.ZipFile(tmp_path / name, "w") as zf:
            zf.writestr("x.txt", name)
    simple = wheels.write_index(tmp_path)
    assert 'href="lltm-op/"' in (simple / "index.html").read_text()
    page = (simple / "lltm-op" / "index.html").read_text()
    assert 'href="../../lltm_op-0.1.0+cu130-py3-none-manylinux_2_28_x86_64.whl#sha256=' in page
    assert wheels.project_of(tmp_path / "round_op-0.1.0-x.whl") == "round-op"


def _abi_report(**torch):
    base = {"uses_torch": True, "stable": True, "unstable_symbols": [], "min_torch_version": "2.10.0"}
    lib = {"path": "/x/lltm_op/_C.abi3.so", "torch": {**base, **torch}, "error": None}
    return {"name": "_C.abi3.so", "extensions": [], "bundled_libs": [lib], "error": None}


def test_torch_abi_audit_report_must_match_the_floor():
    # the shape of torch-abi-audit 0.3.0's --json report of a real binary
    assert wheels.torch_abi(_abi_report(), "2.10") == ([], "_C.abi3.so: stable ABI, torch >= 2.10.0")
    problems, _ = wheels.torch_abi(_abi_report(min_torch_version="2.11.0"), "2.10")
    assert problems == ["_C.abi3.so needs torch >= 2.11.0, the declared floor is 2.10"]
    problems, _ = wheels.torch_abi(_abi_report(min_torch_version="2.9.0"), "2.10")
    assert problems  # older than the floor: the target macro did not take
    problems, _ = wheels.torch_abi(_abi_report(stable=False, unstable_symbols=["_ZN3c106detail"]), "2.10")
    assert "outside the stable ABI" in problems[0]
    problems, _ = wheels.torch_abi({"bundled_libs": [], "extensions": [], "error": None}, "2.10")
    assert "could not read" in problems[0]
