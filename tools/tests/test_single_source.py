"""matrix.toml is the one source of the torch floor, the Python floor and the
arch list. Copies that must exist elsewhere (opscommon's build constants,
which travel in every sdist; the pyprojects; the README) are held to it here."""

from __future__ import annotations

import ast
import re

import pytest

from tools import ROOT, matrix, wheels
from tools.packages import COMMON, PACKAGES, op_packages

M = matrix.load()
BUILD_PY = PACKAGES / COMMON / "src" / "opscommon" / "build.py"
INIT_PY = PACKAGES / COMMON / "src" / "opscommon" / "__init__.py"


def _constant(path, name):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == name for t in targets):
                return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {path}")


def test_torch_floor():
    assert ".".join(map(str, _constant(INIT_PY, "TORCH_TARGET_VERSION"))) == M.torch_floor
    assert min(M.torches, key=lambda s: tuple(map(int, s.split(".")))) == M.torch_floor


def test_abi3_floor():
    major, minor = M.abi3_min.split(".")
    assert _constant(BUILD_PY, "LIMITED_API_HEX") == f"0x{int(major):02X}{int(minor):02X}0000"
    # the wheel's tags: every Python 3 (requires-python sets the floor), no ABI
    assert (_constant(BUILD_PY, "WHEEL_PYTHON_TAG"), _constant(BUILD_PY, "WHEEL_ABI_TAG")) == ("py3", "none")
    assert wheels.PYTHON_TAGS == "py3-none"  # what the release checks require


def test_arch_list():
    assert _constant(BUILD_PY, "DEFAULT_CUDA_ARCH_LIST") == M.arch_list
    assert f"`{M.arch_list}`" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("package", [COMMON, *op_packages()])
def test_pyprojects(package):
    text = (PACKAGES / package / "pyproject.toml").read_text()
    assert f'requires-python = ">={M.abi3_min}"' in text
    assert 'license = "BSD-3-Clause"' in text and 'license-files = ["LICENSE"]' in text
    assert '"setuptools>=77"' in text  # SPDX license strings need setuptools >= 77
    assert (PACKAGES / package / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    if package != COMMON:
        torch_req = f"torch>={M.torch_floor},<{M.torch_ceiling}"
        assert f'dependencies = ["{torch_req}"]' in text
        assert f'"{torch_req}"' in text.split("[project]")[0]  # build requirement
        # the build helper comes from the repository or the sdist, never an index
        assert "opscommon" not in re.sub(r"#.*", "", text)


@pytest.mark.parametrize("package", op_packages())
def test_every_setup_py_is_the_template(package):
    template = (ROOT / "tools" / "templates" / "op" / "setup.py").read_text()
    assert (PACKAGES / package / "setup.py").read_text() == template
