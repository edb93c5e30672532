"""CUDA toolkits of matrix.toml's lanes: where each one's CUDA_HOME is.

Sources (``[[cuda.toolkit]] source``):

- ``pypi``: the exact ``requirements`` install into the session's environment
  (``requirements(tk)``); the toolkit lies at ``home`` under site-packages;
- ``debian``: the exact Debian ``packages`` (``name=version``) of ``suite``
  and ``components`` of the ``archives``, fetched on first use into a cache
  folder with a private apt configuration (the machine's own apt sources and
  state are never read or changed), unpacked there and arranged as a CUDA_HOME
  (``bin/nvcc`` with its own ``nvcc.profile``, ``include``, ``lib64``/``lib``,
  ``nvvm/libdevice``); needs ``apt-get``, ``dpkg-deb`` and the Debian archive
  keyring, and the archive only the first time;
- ``system``: a toolkit of exactly that version already on the machine.

A toolkit named by ``CUDA_HOME`` wins over every source when its nvcc has the
lane's version.

From the command line (prints the CUDA_HOME, fetching it when needed)::

    python -m tools.toolkits 12.4 [--cache DIR]
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from . import ROOT
from .matrix import Toolkit

DEFAULT_CACHE = ROOT / ".nox" / "_cache" / "toolkits"
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# Debian's multiarch library folder and NVIDIA's tool folder inside the packages.
DEBIAN_LIBDIR = "usr/lib/x86_64-linux-gnu"
DEBIAN_TOOLDIR = "usr/lib/nvidia-cuda-toolkit"
# What the CUDA_HOME's bin/nvcc reads (nvcc looks for nvcc.profile next to the
# path it was started by, symlink or not): paths relative to that folder, so the
# cache can move.
NVCC_PROFILE = """\
# Written by tools/toolkits.py: this CUDA_HOME's own profile (Debian's points to /etc).
TOP = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
PATH += $(_HERE_):
INCLUDES += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS +=
PTXAS_FLAGS +=
"""
MANIFEST = "toolkit.json"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class ToolkitUnavailable(RuntimeError):
    """The lane's toolkit cannot be had here; the message says why and what to do."""


def nvcc_release(nvcc: Path) -> str | None:
    """ "13.0" from ``nvcc --version``, or None when it does not run."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def requirements(tk: Toolkit) -> list[str]:
    """What to install into a session's environment for this toolkit."""
    return list(tk.requirements) if tk.source == "pypi" else []


def from_cuda_home(version: str) -> Path | None:
    """CUDA_HOME, when it is set and holds an nvcc of ``version``."""
    home = os.environ.get("CUDA_HOME")
    if home and nvcc_release(Path(home) / "bin" / "nvcc") == version:
        return Path(home)
    return None


def find_system_toolkit(version: str) -> tuple[Path | None, str]:
    """A toolkit of exactly ``version`` on the machine: CUDA_HOME, CUDA_PATH,
    nvcc on PATH, /usr/local/cuda-<version>; (None, why) when there is none."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append(f"/usr/local/cuda-{version}")
    seen = []
    for home in filter(None, candidates):
        release = nvcc_release(Path(home) / "bin" / "nvcc")
        if release == version:
            return Path(home), ""
        if release:
            seen.append(f"CUDA {release} at {home}")
    found = "; found only " + ", ".join(seen) if seen else ""
    return None, f"no CUDA {version} toolkit on this machine{found}: set CUDA_HOME to one"


def _pypi_home(tk: Toolkit, purelib: Path) -> tuple[Path | None, str]:
    home = purelib / (tk.home or "")
    if not (home / "bin" / "nvcc").exists():
        return None, f"{home}/bin/nvcc missing after installing {' '.join(tk.requirements)}"
    lib = home / "lib"
    if not (lib / "libcudart.so").exists():
        sonames = sorted(lib.glob("libcudart.so.*"), key=lambda p: len(p.name))
        if sonames:  # the PyPI runtime ships only the versioned name; the linker wants this one
            (lib / "libcudart.so").symlink_to(sonames[0].name)
    release = nvcc_release(home / "bin" / "nvcc")
    if release != tk.version:
        return None, f"{home}/bin/nvcc is CUDA {release}, not {tk.version}"
    return home, ""


# -- Debian ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DebianSource:
    """The ``source = "debian"`` keys of one ``[[cuda.toolkit]]``."""

    archives: tuple[str, ...]  # tried in order until one has every pinned package
    suite: str
    components: tuple[str, ...]
    packages: tuple[tuple[str, str], ...]  # (name, exact version)
    keyring: str = DEBIAN_KEYRING
    arch: str = "amd64"  # NVIDIA's x86_64 binaries, Debian's x86_64-linux-gnu layout

    @property
    def pins(self) -> list[str]:
        return [f"{name}={version}" for name, version in self.packages]


def debian_source(tk: Toolkit) -> DebianSource:
    """The Debian keys of a toolkit, checked (ValueError names the bad key)."""
    x = dict(tk.extra)
    where = f'matrix.toml: toolkit {tk.version} (source = "debian")'
    archives = x.get("archives")
    if isinstance(archives, str):
        archives = [archives]
    if not archives or not all(isinstance(a, str) and a for a in archives):
        raise ValueError(f"{where} needs `archives`, a list of Debian mirror URLs")
    if not isinstance(x.get("suite"), str) or not x["suite"]:
        raise ValueError(f'{where} needs `suite`, e.g. "trixie"')
    components = x.get("components")
    if not components or not all(isinstance(c, str) and c for c in components):
        raise ValueError(f'{where} needs `components`, e.g. ["main", "non-free"]')
    pins = x.get("packages")
    if not pins:
        raise ValueError(f'{where} needs `packages`, each "name=version"')
    packages = []
    for pin in pins:
        name, sep, version = str(pin).partition("=")
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9+.-]+", name) or not version:
            raise ValueError(f'{where}: package {pin!r} is not "name=exact-version"')
        packages.append((name, version))
    return DebianSource(
        archives=tuple(archives),
        suite=x["suite"],
        components=tuple(components),
        packages=tuple(packages),
        keyring=x.get("keyring", DEBIAN_KEYRING),
    )


def sources_line(src: DebianSource, archive: str) -> str:
    """The one-line apt source of ``archive`` for this toolkit."""
    return (
        f"deb [arch={src.arch} signed-by={src.keyring}] {archive.rstrip('/')} {src.suite} {' '.join(src.components)}\n"
    )


def apt_options(state: Path, archive: str = "", arch: str = "amd64") -> list[str]:
    """``-o`` options that give apt a private configuration under ``state``:
    its own source list, index lists, package cache and (empty) dpkg status,
    none of the machine's; packages of Debian architecture ``arch``."""
    opts = {
        "Dir::Etc::sourcelist": str(state / "sources.list"),
        "Dir::Etc::sourceparts": "-",
        "Dir::Etc::preferences": str(state / "preferences"),
        "Dir::Etc::preferencesparts": "-",
        "Dir::State::Lists": str(state / "lists"),
        "Dir::State::status": str(state / "status"),
        "Dir::Cache": str(state / "cache"),
        "Dir::Cache::pkgcache": "",
        "Dir::Cache::srcpkgcache": "",
        "APT::Architecture": arch,
        "APT::Architectures": arch,
        "Acquire::Languages": "none",
        "Acquire::Retries": "2",
        "Acquire::http::Timeout": "30",
    }
    if "snapshot.debian.org" in archive:  # snapshots outlive their Release's Valid-Until
        opts["Acquire::Check-Valid-Until"] = "false"
    if os.geteuid() == 0:  # root: let apt write as root instead of switching to _apt
        opts["APT::Sandbox::User"] = "root"
    return [arg for k, v in opts.items() for arg in ("-o", f"{k}={v}")]


def deb_file_pattern(name: str, version: str) -> str:
    """Glob of the file ``apt-get download`` writes for ``name=version``
    (an epoch's ':' is written as '%3a')."""
    return f"{glob.escape(name)}_{glob.escape(version.replace(':', '%3a'))}_*.deb"


def cached_debs(src: DebianSource, debs: Path) -> tuple[list[Path], list[str]]:
    """(the .deb files of ``debs`` for the pins, pins with no file there)."""
    found, missing = [], []
    for name, version in src.packages:
        hits = sorted(debs.glob(deb_file_pattern(name, version)))
        if hits:
            found.append(hits[0])
        else:
            missing.append(f"{name}={version}")
    return found, missing


def _tail(text: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("E:", "W:", "Err:"))]
    return " | ".join(lines[-n:]) or (text.strip().splitlines() or ["(no output)"])[-1]


def fetch_debs(src: DebianSource, workdir: Path, log: Callable[[str], None] = _log) -> list[Path]:
    """The pinned .deb files, downloaded into ``workdir/debs`` unless already
    there; ToolkitUnavailable says why when no archive can give them all."""
    debs = workdir / "debs"
    found, missing = cached_debs(src, debs)
    if not missing:
        return found
    if platform.machine() not in ("x86_64", "AMD64"):
        raise ToolkitUnavailable(f"the Debian CUDA packages of this lane are for x86_64, not {platform.machine()}")
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise ToolkitUnavailable(
                f"{tool} is not installed: the Debian toolkit needs apt-get and dpkg-deb (a Debian or Ubuntu machine)"
            )
    if not Path(src.keyring).is_file():
        raise ToolkitUnavailable(
            f"the Debian archive keyring {src.keyring} is missing (apt-get install debian-archive-keyring)"
        )
    debs.mkdir(parents=True, exist_ok=True)
    problems = []
    for archive in src.archives:
        state = workdir / "apt"
        shutil.rmtree(state, ignore_errors=True)
        for sub in ("lists/partial", "cache/archives/partial"):
            (state / sub).mkdir(parents=True)
        (state / "status").touch()
        (state / "preferences").touch()
        (state / "sources.list").write_text(sources_line(src, archive))
        opts = apt_options(state, archive)
        where = f"{archive} {src.suite} ({' '.join(src.components)})"
        log(f"toolkits: apt-get update of {where} (private configuration in {state})")
        upd = subprocess.run(["apt-get", *opts, "update"], capture_output=True, text=True)
        lists = list((state / "lists").glob("*_Packages*"))
        failed = re.search(r"^(E:|W: Failed to fetch|Err:)", upd.stdout + upd.stderr, re.M)
        if upd.returncode != 0 or not lists or failed:
            problems.append(f"{where} cannot be reached: {_tail(upd.stdout + upd.stderr)}")
            continue
        _, missing = cached_debs(src, debs)
        log(f"toolkits: apt-get download {' '.join(missing)} into {debs}")
        start = time.perf_counter()
        dl = subprocess.run(["apt-get", *opts, "download", *missing], cwd=debs, capture_output=True, text=True)
        found, still = cached_debs(src, debs)
        if dl.returncode == 0 and not still:
            log(f"toolkits: downloaded in {time.perf_counter() - start:.0f} s")
            return found
        problems.append(f"{where} does not give {' '.join(still)}: {_tail(dl.stdout + dl.stderr)}")
    raise ToolkitUnavailable("; ".join(problems))


# Static libraries a CUDA_HOME keeps: the CUDA runtime (nvcc links programs with
# it by default), the device runtime (-rdc) and what the former needs.
KEEP_STATIC = frozenset({"libcudart_static.a", "libcudadevrt.a", "libculibos.a"})


def _keep(member: str) -> bool:
    """What of a Debian package the CUDA_HOME needs: everything but the
    documentation and the static libraries (2.3 GB of nvidia-cuda-dev that no
    extension build links) other than :data:`KEEP_STATIC`."""
    path = PurePosixPath(member.lstrip("./"))
    if path.parts[:2] == ("usr", "share"):
        return False
    return not (path.suffix == ".a" and path.name not in KEEP_STATIC)


def unpack_deb(deb: Path, dest: Path) -> None:
    """``dpkg -x`` of ``deb`` into ``dest``, less what :func:`_keep` drops."""
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    kwargs = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tf:
            for member in tf:
                if _keep(member.name):
                    tf.extract(member, dest, **kwargs)
    finally:
        proc.stdout.close()
        if proc.wait() != 0:
            raise ToolkitUnavailable(
                f"dpkg-deb could not unpack {deb} (exit {proc.returncode}): delete it to fetch it again"
            )


def arrange_home(home: Path) -> None:
    """Make ``home`` (which holds the unpacked packages in ``home/debian``) a
    CUDA_HOME: ``bin/`` links to NVIDIA's tools and its own ``nvcc.profile``,
    ``include``, ``lib64`` (and ``lib``), ``nvvm/libdevice``. Relative links only."""
    deb = home / "debian"
    # Debian's links into /etc (nvcc.profile) and to the libraries of packages
    # not fetched (cuBLAS, cuFFT, ...): nothing here may lead out of the folder.
    for link in [p for p in deb.rglob("*") if p.is_symlink()]:
        if os.path.isabs(os.readlink(link)) or not link.exists():
            link.unlink()
    bin_ = home / "bin"
    bin_.mkdir()
    tools = deb / DEBIAN_TOOLDIR / "bin"  # nvcc, cicc, crt/ (Debian's /usr/bin/nvcc is a wrapper script)
    for entry in sorted(tools.iterdir()):
        if entry.name not in ("nvcc.profile", "gcc", "g++"):  # Debian's profile and host compiler pickers
            (bin_ / entry.name).symlink_to(os.path.relpath(entry, bin_))
    for entry in sorted((deb / "usr" / "bin").iterdir()):
        link = bin_ / entry.name
        if not (link.is_symlink() or link.exists()) and entry.name != "nvcc":
            link.symlink_to(os.path.relpath(entry, bin_))
    (bin_ / "nvcc.profile").write_text(NVCC_PROFILE)
    (home / "include").symlink_to("debian/usr/include")
    (home / "lib64").symlink_to(f"debian/{DEBIAN_LIBDIR}")
    (home / "lib").symlink_to("lib64")
    (home / "nvvm").mkdir()
    (home / "nvvm" / "libdevice").symlink_to(f"../debian/{DEBIAN_TOOLDIR}/libdevice")
    for path, what in (
        (bin_ / "nvcc", "nvcc"),
        (bin_ / "cicc", "cicc"),
        (bin_ / "ptxas", "ptxas"),
        (home / "include" / "cuda_runtime.h", "the CUDA headers (nvidia-cuda-dev)"),
        (home / "include" / "nv" / "target", "nv/target (libcu++-dev)"),
        (home / "lib64" / "libcudart.so", "libcudart.so (nvidia-cuda-dev, libcudart12)"),
        (home / "nvvm" / "libdevice" / "libdevice.10.bc", "libdevice (nvidia-cuda-toolkit)"),
    ):
        if not path.exists():
            raise ToolkitUnavailable(
                f"the Debian packages gave no {what} ({path}): check the `packages` of matrix.toml"
            )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time builds a cached toolkit."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def debian_dir(tk: Toolkit, cache: Path) -> Path:
    """Folder of one Debian toolkit in the cache: ``debs/``, ``apt/``, ``home/``."""
    return cache / f"debian-cuda-{tk.version}"


def _ready(home: Path, tk: Toolkit, src: DebianSource) -> bool:
    try:
        manifest = json.loads((home / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("packages") == src.pins and nvcc_release(home / "bin" / "nvcc") == tk.version


def debian_home(tk: Toolkit, cache: Path, log: Callable[[str], None] = _log) -> Path:
    """CUDA_HOME of a Debian toolkit, fetched and arranged in ``cache`` on first
    use; ToolkitUnavailable says why it cannot be had."""
    try:
        src = debian_source(tk)
    except ValueError as e:
        raise ToolkitUnavailable(str(e)) from None
    workdir = debian_dir(tk, Path(cache).resolve())
    home = workdir / "home"
    if _ready(home, tk, src):
        return home
    with _locked(workdir / "lock"):
        if _ready(home, tk, src):  # another process made it meanwhile
            return home
        debs = fetch_debs(src, workdir, log)
        partial = workdir / "home.partial"
        shutil.rmtree(partial, ignore_errors=True)
        start = time.perf_counter()
        for deb in debs:
            unpack_deb(deb, partial / "debian")
        arrange_home(partial)
        release = nvcc_release(partial / "bin" / "nvcc")
        if release != tk.version:
            raise ToolkitUnavailable(
                f"{partial}/bin/nvcc is CUDA {release or '(does not run)'}, "
                f"not {tk.version}: check the `packages` of matrix.toml"
            )
        (partial / MANIFEST).write_text(
            json.dumps(
                {
                    "version": tk.version,
                    "source": "debian",
                    "suite": src.suite,
                    "packages": src.pins,
                    "debs": [d.name for d in debs],
                },
                indent=2,
            )
            + "\n"
        )
        shutil.rmtree(home, ignore_errors=True)
        partial.rename(home)
        log(f"toolkits: CUDA {tk.version} unpacked into {home} in {time.perf_counter() - start:.0f} s")
    return home


def _debian(tk: Toolkit, cache: Path | None) -> tuple[Path | None, str]:
    try:
        return debian_home(tk, DEFAULT_CACHE if cache is None else cache), ""
    except ToolkitUnavailable as e:
        return None, (
            f"CUDA {tk.version} comes from Debian's packages and cannot be had here: {str(e).rstrip('.')}. "
            f"Set CUDA_HOME to a CUDA {tk.version} toolkit, or fetch it once where the archive "
            f"can be reached (python -m tools.toolkits {tk.version})"
        )


# -- host compiler ----------------------------------------------------------------------


def max_host_gcc(home: Path) -> int | None:
    """Newest GCC major the toolkit accepts as host compiler (its
    ``crt/host_config.h``: ``#if __GNUC__ > 13`` -> 13), None if unknown."""
    try:
        text = (Path(home) / "include" / "crt" / "host_config.h").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"#if\s+__GNUC__\s*>\s*(\d+)", text)
    return int(m.group(1)) if m else None


def gcc_major(compiler: str) -> int | None:
    try:
        out = subprocess.run([compiler, "-dumpversion"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.match(r"(\d+)", out.strip())
    return int(m.group(1)) if m else None


def pick_ccbin(default_major: int | None, limit: int | None, available: dict[int, str]) -> str | None:
    """The host compiler nvcc must be given (``-ccbin``), or None when the
    default one will do: the newest of ``available`` (major -> path) within
    ``limit`` when the default is newer than the toolkit accepts."""
    if limit is None or default_major is None or default_major <= limit:
        return None
    fits = [major for major in available if major <= limit]
    return available[max(fits)] if fits else None


def build_env(tk: Toolkit, home: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a CUDA build with this toolkit: CUDA_HOME, its arch list
    and, where the machine's default g++ is newer than the toolkit accepts
    (CUDA 12.4: GCC <= 13) and an older ``g++-N`` is installed, nvcc's host
    compiler through NVCC_PREPEND_FLAGS (unless CC or NVCC_PREPEND_FLAGS is set:
    torch passes ``-ccbin $CC`` itself)."""
    environ = dict(os.environ if environ is None else environ)
    env = {"CUDA_HOME": str(home), "TORCH_CUDA_ARCH_LIST": tk.arch_list}
    if environ.get("CC") or environ.get("NVCC_PREPEND_FLAGS"):
        return env
    limit = max_host_gcc(home)
    default = gcc_major("g++")
    if limit is None or default is None or default <= limit:
        return env
    available = {}
    for major in range(limit, limit - 6, -1):
        path = shutil.which(f"g++-{major}")
        if path:
            available[major] = path
    ccbin = pick_ccbin(default, limit, available)
    if ccbin:
        env["NVCC_PREPEND_FLAGS"] = f"-ccbin {ccbin}"
    return env


# -- any source ---------------------------------------------------------------------------


def locate(tk: Toolkit, purelib: Path | None = None, cache: Path | None = None) -> tuple[Path | None, str]:
    """CUDA_HOME of the toolkit, or (None, why).

    ``purelib``: site-packages of the environment where ``requirements(tk)``
    were installed (PyPI toolkits); ``cache``: a folder where toolkits that
    are fetched (Debian) are kept between runs (default ``.nox/_cache/toolkits``).
    """
    home = from_cuda_home(tk.version)
    if home is not None:
        return home, ""
    if tk.source == "pypi":
        if purelib is None:
            return None, f"CUDA {tk.version} comes from PyPI: install {' '.join(tk.requirements)} first"
        return _pypi_home(tk, purelib)
    if tk.source == "debian":
        return _debian(tk, cache)
    return find_system_toolkit(tk.version)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from . import matrix

    parser = argparse.ArgumentParser(description="Print the CUDA_HOME of a matrix.toml toolkit, fetching it if needed.")
    parser.add_argument("version", help="toolkit version of matrix.toml, e.g. 12.4")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    tk = matrix.load().toolkits.get(args.version)
    if tk is None:
        print(f"no toolkit {args.version} in matrix.toml", file=sys.stderr)
        return 2
    home, reason = locate(tk, cache=args.cache)
    if home is None:
        print(reason, file=sys.stderr)
        return 1
    print(home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
