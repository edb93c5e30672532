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
