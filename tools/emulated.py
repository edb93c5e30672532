"""Another CPU's wheels run on this machine: an aarch64 CPython under
``qemu-aarch64`` (user-mode emulation), for the aarch64 test lane.

- The interpreter and the C libraries it and torch load are Debian's
  packages for that CPU (``[platform.test] python_packages`` of ``suite``),
  fetched with a private apt configuration (the machine's apt sources, state
  and installed packages are never read or changed) and unpacked into a
  sysroot in the cache; qemu finds them there (``-L``).
- qemu-user 7.2 shows the program the build machine's own ``/proc/cpuinfo``
  and no ``midr_el1`` in sysfs, and torch's CPU detection (cpuinfo, oneDNN)
  crashes at import on an x86 description. The sysroot carries what an Arm
  Neoverse N1 Linux shows there; qemu's ``-L`` makes the emulated program read
  those files. The instructions the program may use are qemu's own CPU's
  (its ``AT_HWCAP``), whatever that description says.
- ``usr/bin/python3`` of the sysroot is a script that starts the interpreter
  under qemu with itself as ``argv[0]``, so ``sys.executable`` is that script
  and a test that starts ``sys.executable`` in a subprocess gets the emulated
  interpreter too (this machine has no binfmt_misc entry for aarch64).
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import toolkits

MANIFEST = "sysroot.json"
# What an Arm Neoverse N1 (Graviton 2, Ampere Altra) Linux shows, per CPU.
_CPUINFO = (
    "processor\t: {n}\nBogoMIPS\t: 50.00\n"
    "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop "
    "asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\n"
    "CPU revision\t: 1\n\n"
)
_MIDR_EL1 = "0x00000000413fd0c1\n"


class EmulationUnavailable(RuntimeError):
    """The lane cannot run here; the message says why and what to install."""


def _log(message: str) -> None:
    print(message, flush=True)


def emulator_missing(test: Mapping[str, Any]) -> str | None:
    """Why the platform's emulator cannot run here, or None."""
    emulator = test.get("emulator", "")
    if not emulator:
        return "matrix.toml gives this platform no emulator ([platform.test] emulator)"
    if shutil.which(emulator) is None:
        package = test.get("emulator_package")
        return f"{emulator} is not installed" + (f" (Debian/Ubuntu: apt-get install {package})" if package else "")
    return None


def _apt_state(state: Path, test: Mapping[str, Any], archive: str) -> list[str]:
    shutil.rmtree(state, ignore_errors=True)
    for sub in ("lists/partial", "cache/archives/partial"):
        (state / sub).mkdir(parents=True)
    (state / "status").touch()
    (state / "preferences").touch()
    arch = test["debian_arch"]
    keyring = test.get("keyring", toolkits.DEBIAN_KEYRING)
    (state / "sources.list").write_text(
        f"deb [arch={arch} signed-by={keyring}] {archive.rstrip('/')} {test['suite']} {' '.join(test['components'])}\n"
    )
    return toolkits.apt_options(state, archive, arch)


def fetch_debs(test: Mapping[str, Any], workdir: Path, log: Callable[[str], None] = _log) -> list[Path]:
    """The ``python_packages`` of the suite for the platform's Debian
    architecture, downloaded into ``workdir/debs`` (the suite's current
    versions)."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise EmulationUnavailable(f"{tool} is not installed: the emulated Python comes from Debian packages")
    if not Path(test.get("keyring", toolkits.DEBIAN_KEYRING)).is_file():
        raise EmulationUnavailable("the Debian archive keyring is missing (apt-get install debian-archive-keyring)")
    packages = list(test["python_packages"])
    problems = []
    for archive in test["archives"]:
        debs = workdir / "debs"
        shutil.rmtree(debs, ignore_errors=True)
        debs.mkdir(parents=True)
        opts = _apt_state(workdir / "apt", test, archive)
        where = f"{archive} {test['suite']} ({test['debian_arch']})"
        upd = subprocess.run(["apt-get", *opts, "update"], capture_output=True, text=True)
        if upd.returncode != 0 or not list((workdir / "apt" / "lists").glob("*_Packages*")):
            problems.append(f"{where} cannot be reached: {toolkits._tail(upd.stdout + upd.stderr)}")
            continue
        start = time.perf_counter()
        dl = subprocess.run(["apt-get", *opts, "download", *packages], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob("*.deb"))
        if dl.returncode == 0 and len(found) == len(packages):
            size = sum(p.stat().st_size for p in found) / 2**20
            took = time.perf_counter() - start
            log(f"emulated: {len(found)} Debian packages of {where}, {size:.0f} MiB, in {took:.0f} s")
            return found
        problems.append(f"{where} does not give them all: {toolkits._tail(dl.stdout + dl.stderr)}")
    raise EmulationUnavailable("; ".join(problems))


def describe_cpu(root: Path, cpus: int) -> None:
    """``/proc/cpuinfo`` and ``midr_el1`` of an aarch64 Linux, in the sysroot."""
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "cpuinfo").write_text("".join(_CPUINFO.format(n=n) for n in range(cpus)))
    for n in range(cpus):
        ident = root / "sys" / "devices" / "system" / "cpu" / f"cpu{n}" / "regs" / "identification"
        ident.mkdir(parents=True, exist_ok=True)
        (ident / "midr_el1").write_text(_MIDR_EL1)


def write_wrapper(root: Path, emulator: str, python: str) -> Path:
    """``root/usr/bin/python3``: the emulated interpreter, itself as argv[0]."""
    wrapper = root / "usr" / "bin" / "python3"
    real = root / "usr" / "bin" / f"python{python}"
    wrapper.unlink(missing_ok=True)
    wrapper.write_text(
        "#!/bin/sh\n# The aarch64 CPython under qemu-user (tools/emulated.py).\n"
        f'exec {shlex.quote(emulator)} -L {shlex.quote(str(root))} -0 "$0" {shlex.quote(str(real))} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def sysroot(test: Mapping[str, Any], cache: Path, cpus: int, log: Callable[[str], None] = _log) -> Path:
    """The emulated interpreter (the sysroot's ``usr/bin/python3``), made in
    ``cache`` on first use; EmulationUnavailable says why it cannot be had."""
    workdir = Path(cache).resolve() / f"{test['debian_arch']}-{test['suite']}-python{test['python']}"
    root = workdir / "root"
    want = {"packages": list(test["python_packages"]), "python": test["python"], "suite": test["suite"]}
    try:
        ready = json.loads((workdir / MANIFEST).read_text()) == want
    except (OSError, ValueError):
        ready = False
    if not ready:
        debs = fetch_debs(test, workdir, log)
        shutil.rmtree(root, ignore_errors=True)
        for deb in debs:
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        if not (root / "usr" / "bin" / f"python{test['python']}").is_file():
            raise EmulationUnavailable(f"the Debian packages gave no usr/bin/python{test['python']}")
        (workdir / MANIFEST).write_text(json.dumps(want))
    describe_cpu(root, cpus)
    wrapper = write_wrapper(root, test["emulator"], test["python"])
    out = subprocess.run(
        [str(wrapper), "-c", "import platform, sys; print(platform.machine(), sys.version.split()[0])"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise EmulationUnavailable(f"the emulated Python does not start: {out.stderr.strip()[-500:]}")
    log(f"emulated: {wrapper} is {out.stdout.strip()}")
    return wrapper
