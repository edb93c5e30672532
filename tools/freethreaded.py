"""A free-threaded CPython (``3.13t``) for the free-threaded test lane.

The op wheels are ``py3-none-<platform>``: their library needs no Python, so
they install on a free-threaded CPython, where an abi3 wheel does not. The
lane proves it on a real one, found or made in this order:

- ``OPS_FREETHREADED_PYTHON``: an interpreter to use (it must be a
  free-threaded build of ``[python.freethreaded] version``);
- ``python<version>t`` on ``PATH`` (a distribution's or a uv-installed one);
- built once into the cache from the upstream CPython source that Debian's
  source package (``source_package`` of ``suite``) carries, fetched with a
  private apt configuration (the machine's apt sources are not read or
  changed), ``./configure --disable-gil``. Debian's own patches are not
  applied: this is upstream CPython, the source Debian's archive serves.

``Unavailable`` says why none can be had; the lane is then skipped, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import toolkits

ENV = "OPS_FREETHREADED_PYTHON"
MANIFEST = "build.json"
# Modules the lane needs of the interpreter it builds: torch loads its
# libraries with ctypes; wheels are zip files; pip (where uv is missing)
# fetches over TLS.
NEEDED_MODULES = ("ctypes", "zlib", "ssl", "bz2", "lzma", "sqlite3")
_DEV_PACKAGES = "libffi-dev zlib1g-dev libssl-dev libbz2-dev liblzma-dev libsqlite3-dev"
_PROBE = (
    "import json, sys, sysconfig; print(json.dumps({'free_threaded': bool(sysconfig.get_config_var('Py_GIL_DISABLED')),"
    " 'version': '%d.%d' % sys.version_info[:2], 'full': sys.version.split()[0]}))"
)


class Unavailable(RuntimeError):
    """No free-threaded CPython can be had here; the message says why."""


def _log(message: str) -> None:
    print(message, flush=True)


def probe(python: str | os.PathLike) -> dict:
    """{"free_threaded": bool, "version": "3.13", "full": "3.13.5"} of an interpreter."""
    try:
        out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True)
    except OSError as exc:
        raise Unavailable(f"{python} does not run: {exc}") from None
    if out.returncode != 0:
        raise Unavailable(f"{python} does not run: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


def check(python: str | os.PathLike, version: str) -> dict:
    """The probe of ``python``, or Unavailable when it is not a free-threaded ``version``."""
    info = probe(python)
    if not info["free_threaded"] or info["version"] != version:
        what = "free-threaded" if info["free_threaded"] else "a build with the GIL"
        raise Unavailable(f"{python} is CPython {info['full']}, {what}: the lane needs a free-threaded {version}")
    return info


def found(cfg: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Path | None:
    """An interpreter named by ``OPS_FREETHREADED_PYTHON`` or on ``PATH``; None if neither."""
    env = os.environ if env is None else env
    if env.get(ENV):
        return Path(env[ENV])
    on_path = shutil.which(f"python{cfg['version']}t", path=env.get("PATH"))
    return Path(on_path) if on_path else None


def fetch_source(cfg: Mapping[str, Any], workdir: Path, log: Callable[[str], None] = _log) -> Path:
    """The upstream CPython tarball of ``source_package`` (the suite's current
    version), downloaded with apt (which checks it against the archive's
    signed index) into ``workdir/src``."""
    for tool in ("apt-get", "tar", "make", "gcc"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} is not installed: building the free-threaded CPython needs it")
    keyring = cfg.get("keyring", toolkits.DEBIAN_KEYRING)
    if not Path(keyring).is_file():
        raise Unavailable("the Debian archive keyring is missing (apt-get install debian-archive-keyring)")
    package = cfg["source_package"]
    problems = []
    for archive in cfg["archives"]:
        state = workdir / "apt"
        shutil.rmtree(state, ignore_errors=True)
        for sub in ("lists/partial", "cache/archives/partial"):
            (state / sub).mkdir(parents=True)
        (state / "status").touch()
        (state / "preferences").touch()
        (state / "sources.list").write_text(
            f"deb-src [signed-by={keyring}] {archive.rstrip('/')} {cfg['suite']} {' '.join(cfg['components'])}\n"
        )
        opts = toolkits.apt_options(state, archive)
        where = f"{archive} {cfg['suite']}"
        upd = subprocess.run(["apt-get", *opts, "update"], capture_output=True, text=True)
        if upd.returncode != 0 or not list((state / "lists").glob("*_Sources*")):
            problems.append(f"{where} cannot be reached: {toolkits._tail(upd.stdout + upd.stderr)}")
            continue
        src = workdir / "src"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        start = time.perf_counter()
        dl = subprocess.run(
            ["apt-get", *opts, "source", "--download-only", package], cwd=src, capture_output=True, text=True
        )
        tarballs = sorted(src.glob(f"{package}_*.orig.tar.*"))
        tarballs = [t for t in tarballs if not t.name.endswith(".asc")]
        if dl.returncode == 0 and tarballs:
            size = tarballs[0].stat().st_size / 2**20
            log(f"free-threaded: {tarballs[0].name} of {where}, {size:.0f} MiB, in {time.perf_counter() - start:.0f} s")
            return tarballs[0]
        problems.append(f"{where} does not give the source of {package}: {toolkits._tail(dl.stdout + dl.stderr)}")
    raise Unavailable("; ".join(problems))


def build(cfg: Mapping[str, Any], cache: Path, jobs: int, log: Callable[[str], None] = _log) -> Path:
    """The free-threaded interpreter built from source in ``cache`` (once:
    later calls find it), ``<prefix>/bin/python<version>t``."""
    version = cfg["version"]
    workdir = Path(cache).resolve() / f"cpython-{version}t-{cfg['suite']}"
    prefix = workdir / "install"
    python = prefix / "bin" / f"python{version}t"
    try:
        manifest = json.loads((workdir / MANIFEST).read_text())
    except (OSError, ValueError):
        manifest = {}
    if manifest.get("version") == version and python.is_file():
        return python
    tarball = fetch_source(cfg, workdir, log)
    tree = workdir / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.rmtree(prefix, ignore_errors=True)
    tree.mkdir()
    subprocess.run(["tar", "-xf", str(tarball), "-C", str(tree), "--strip-components=1"], check=True)
    start = time.perf_counter()
    steps = {
        "configure": ["./configure", "--disable-gil", f"--prefix={prefix}"],
        "make": ["make", f"-j{jobs}"],
        "install": ["make", "install"],  # with pip (ensurepip), for a machine without uv
    }
    for name, cmd in steps.items():
        out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
        (workdir / f"{name}.log").write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            raise Unavailable(f"building CPython {version}t failed at `{' '.join(cmd)}`: {toolkits._tail(out.stderr)}")
    took = time.perf_counter() - start
    missing = subprocess.run(
        [str(python), "-c", f"import importlib; [importlib.import_module(m) for m in {list(NEEDED_MODULES)!r}]"],
        capture_output=True,
        text=True,
    )
    if missing.returncode != 0:
        raise Unavailable(
            f"CPython {version}t built without a module the lane needs ({missing.stderr.strip().splitlines()[-1]}): "
            f"install the headers (Debian/Ubuntu: apt-get install {_DEV_PACKAGES}) and run again"
        )
    info = check(python, version)
    shutil.rmtree(tree)  # 600 MB of objects; the tarball stays for a rebuild
    (workdir / MANIFEST).write_text(json.dumps({"version": version, "full": info["full"], "seconds": round(took)}))
    log(f"free-threaded: CPython {info['full']} (--disable-gil) built in {took:.0f} s into {prefix}")
    return python


def interpreter(cfg: Mapping[str, Any], cache: Path, jobs: int, log: Callable[[str], None] = _log) -> Path:
    """The lane's free-threaded interpreter: named, on PATH, or built (see
    the module docstring); Unavailable says why none can be had."""
    if not cfg:
        raise Unavailable("matrix.toml has no [python.freethreaded] table")
    python = found(cfg)
    if python is not None:
        info = check(python, cfg["version"])
        log(f"free-threaded: {python} (CPython {info['full']})")
        return python
    return build(cfg, cache, jobs, log)
