"""Symbol versions of real binaries, and the per-variant PEP 503 index."""

from __future__ import annotations

import shutil
import subprocess
import zipfile

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


def _build(tmp_path, flags):
    (tmp_path / "t.cpp").write_text(SOURCE)
    out = tmp_path / f"t{len(flags)}.so"
    subprocess.run(
        ["g++", "-O2", "-shared", "-fPIC", "-std=c++17", *flags, str(tmp_path / "t.cpp"), "-o", str(out)], check=True
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


def test_index_is_pep_503(tmp_path):
    for name in (
        "lltm_op-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl",
        "round_op-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl",
    ):
        with zipfile.ZipFile(tmp_path / name, "w") as zf:
            zf.writestr("x.txt", name)
    simple = wheels.write_index(tmp_path)
    assert 'href="lltm-op/"' in (simple / "index.html").read_text()
    page = (simple / "lltm-op" / "index.html").read_text()
    assert 'href="../../lltm_op-0.1.0+cu130-cp310-abi3-manylinux_2_28_x86_64.whl#sha256=' in page
    assert wheels.project_of(tmp_path / "round_op-0.1.0-x.whl") == "round-op"
