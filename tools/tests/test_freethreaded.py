"""The free-threaded lane's pieces that need no free-threaded interpreter
(the lane itself is `nox -s test_freethreaded`)."""

from __future__ import annotations

import sys
import sysconfig

import pytest

from tools import freethreaded, matrix

M = matrix.load()


def test_matrix_names_a_free_threaded_python_and_a_torch_with_its_wheels():
    ft = M.freethreaded
    assert ft["version"] == "3.13" and ft["source_package"] == f"python{ft['version']}"
    # PyPI's torch has cp313t wheels up to 2.11; and the stable-ABI floor holds
    assert ft["torch"] in M.torches and tuple(map(int, ft["torch"].split("."))) >= (2, 10)


def test_matrix_refuses_a_free_threaded_lane_without_a_listed_torch():
    data = matrix.tomllib.loads(matrix.MATRIX_FILE.read_text())
    data["python"]["freethreaded"]["torch"] = "1.0"
    with pytest.raises(ValueError, match="python.freethreaded"):
        matrix.parse(data)


def test_probe_reads_the_running_interpreter():
    info = freethreaded.probe(sys.executable)
    assert info["version"] == "{}.{}".format(*sys.version_info[:2])
    assert info["free_threaded"] == bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


@pytest.mark.skipif(bool(sysconfig.get_config_var("Py_GIL_DISABLED")), reason="needs a build with the GIL")
def test_a_build_with_the_gil_is_refused():
    version = "{}.{}".format(*sys.version_info[:2])
    with pytest.raises(freethreaded.Unavailable, match="with the GIL: the lane needs a free-threaded"):
        freethreaded.check(sys.executable, version)


def test_an_interpreter_that_does_not_run_is_unavailable(tmp_path):
    with pytest.raises(freethreaded.Unavailable, match="does not run"):
        freethreaded.probe(tmp_path / "python3.13t")


def test_found_prefers_the_variable_then_path(tmp_path):
    cfg = {"version": "3.13"}
    exe = tmp_path / "python3.13t"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert freethreaded.found(cfg, {"PATH": str(tmp_path)}) == exe
    assert freethreaded.found(cfg, {freethreaded.ENV: "/x/py", "PATH": str(tmp_path)}).as_posix() == "/x/py"
    assert freethreaded.found(cfg, {"PATH": str(tmp_path / "none")}) is None


def test_no_configuration_is_unavailable(tmp_path):
    with pytest.raises(freethreaded.Unavailable, match="no \\[python.freethreaded\\]"):
        freethreaded.interpreter({}, tmp_path, 1)
