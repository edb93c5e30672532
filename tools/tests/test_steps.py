"""Session steps that need no session: arguments, uv configuration, suites."""

from __future__ import annotations

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
