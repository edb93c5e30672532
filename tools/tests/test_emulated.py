"""The emulated aarch64 lane's pieces that need no emulator (the lane itself
is `nox -s test_aarch64`)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tools import emulated, matrix


def test_emulator_missing_says_what_to_install():
    assert "nosuch-qemu is not installed (Debian/Ubuntu: apt-get install qemu-user)" == emulated.emulator_missing(
        {"emulator": "nosuch-qemu", "emulator_package": "qemu-user"}
    )
    assert "no emulator" in emulated.emulator_missing({})


def test_matrix_names_the_emulated_python():
    test = matrix.load().platforms["aarch64"].test
    assert test["emulator"] == "qemu-aarch64" and test["debian_arch"] == "arm64"
    # the interpreter whose ABI the aarch64 torch wheel is installed for
    assert f"python{test['python']}-minimal" in test["python_packages"]


def test_cpu_description_is_an_aarch64_linux(tmp_path):
    emulated.describe_cpu(tmp_path, 3)
    info = (tmp_path / "proc" / "cpuinfo").read_text()
    assert info.count("processor\t:") == 3 and "CPU implementer\t: 0x41" in info and "asimd" in info
    midr = tmp_path / "sys/devices/system/cpu/cpu2/regs/identification/midr_el1"
    assert int(midr.read_text(), 16) >> 24 == 0x41  # Arm Ltd.


def test_wrapper_starts_the_interpreter_under_the_emulator_as_itself(tmp_path):
    # a stand-in emulator that prints what it was asked to run
    fake = tmp_path / "emu"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    if shutil.which("sh") is None:
        pytest.skip("needs sh")
    (tmp_path / "root/usr/bin").mkdir(parents=True)
    wrapper = emulated.write_wrapper(tmp_path / "root", str(fake), "3.11")
    out = subprocess.run([str(wrapper), "-c", "pass"], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:6] == [
        "-L",
        str(tmp_path / "root"),
        "-0",
        str(wrapper),
        str(tmp_path / "root/usr/bin/python3.11"),
        "-c",
    ]
    assert os.access(wrapper, os.X_OK)
