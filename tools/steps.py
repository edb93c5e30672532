"""Steps the nox sessions share: environments, builds, installs, test runs.

Each function takes the nox session it works in. Built wheels are installed
with ``session.run`` (not ``session.install``), so ``nox -R`` (no installs)
still installs what the session has just built: it never tests stale wheels.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ROOT, toolkits
from .matrix import Matrix, Platform, Toolkit
from .packages import COMMON, PACKAGES, import_name, op_packages
from .results import Results

SCRIPTS = ROOT / "scripts"
CACHE = ROOT / ".nox" / "_cache"  # unpacked torch headers, fetched toolkits
# What building and testing needs besides torch (the packages' build
# requirements and `test` extras; tools/tests holds them to the pyprojects).
BUILD_REQS = ["setuptools>=77", "wheel", "ninja", "build"]
TEST_REQS = ["pytest", "hypothesis", "numpy"]
# Lint (nox -s lint, and tools/tests/test_lint.py in every tests session): pinned, so a
# new release of either never fails a run on code that did not change.
LINT_REQS = ["ruff==0.17.6", "clang-format==23.1.5"]
try:  # what a failed session.run raises; the unit tests import this module without nox
    from nox.command import CommandFailed
except ImportError:  # pragma: no cover
    CommandFailed = subprocess.CalledProcessError  # type: ignore[misc,assignment]


# -- package sources: uv reads what pip is configured with ----------------------


def pip_config() -> dict[str, list[str]]:
    """Values of `pip config list` (files and PIP_* variables), by option name."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    values: dict[str, list[str]] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        name = key.rsplit(".", 1)[-1]
        for item in value.strip().strip("'\"").split():
            if item not in values.setdefault(name, []):
                values[name].append(item)
    return values


def uv_env_from_pip(cfg: dict[str, list[str]]) -> dict[str, str]:
    """uv's variables for the indexes, local wheel folders and constraints pip uses.

    uv ignores pip's configuration; without this it would miss local mirrors
    and the constraints a machine sets. With no pip configuration: nothing.
    """
    env: dict[str, str] = {}
    if cfg.get("index-url"):
        env["UV_DEFAULT_INDEX"] = cfg["index-url"][-1]
    if cfg.get("extra-index-url"):
        env["UV_EXTRA_INDEX_URL"] = " ".join(cfg["extra-index-url"])
    if cfg.get("find-links"):
        env["UV_FIND_LINKS"] = ",".join(cfg["find-links"])
    if cfg.get("extra-index-url") or cfg.get("find-links"):
        # pip picks the best version over every source; uv's default stops at
        # the first index that has the package.
        env["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    if cfg.get("constraint"):
        env["UV_CONSTRAINT"] = " ".join(cfg["constraint"])
    return env


def configure_uv() -> None:
    """Set uv's variables from pip's configuration; variables already set win."""
    for key, value in uv_env_from_pip(pip_config()).items():
        os.environ.setdefault(key, value)


# -- positional arguments ---------------------------------------------------------


@dataclass
class Args:
    """``nox -s SESSION -- ARGS``: package names, flags, the rest for pytest."""

    packages: list[str]  # op packages to build
    suites: list[str] | None  # test suites chosen (None: all)
    rest: list[str] = field(default_factory=list)
    flags: set[str] = field(default_factory=set)


def parse_args(posargs: list[str], flags: set[str] = frozenset(), root: Path = PACKAGES) -> Args:
    """Split posargs: op packages (folder or import name), ``opscommon``,
    ``tools`` and ``integration`` suites, known ``flags``, and the rest."""
    ops = op_packages(root)
    known = {p: p for p in ops} | {import_name(p): p for p in ops}
    known |= {s: s for s in (COMMON, "tools", "integration")}
    chosen: list[str] = []
    args = Args(ops, None)
    for arg in posargs:
        if arg in flags:
            args.flags.add(arg)
        elif arg in known:
            chosen.append(known[arg])
        elif not arg.startswith("-") and (root / arg).is_dir():
            raise ValueError(f"packages/{arg} has no setup.py yet: nothing to build")
        else:
            args.rest.append(arg)
    if chosen:
        args.suites = chosen
        # the integration tests use every op package
        args.packages = ops if "integration" in chosen else [p for p in ops if p in chosen]
    return args


# -- the session's environment -------------------------------------------------------


def tmp(session: Any, name: str) -> Path:
    """A fresh folder in the session's temporary folder."""
    path = Path(session.create_tmp()).resolve() / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def py(session: Any, expr: str, setup: str = "") -> str:
    """Evaluate a Python expression in the session's environment, as text."""
    out = session.run("python", "-c", f"{setup}\nprint('@@nox@@', {expr})", silent=True, log=False) or ""
    lines = [line for line in out.splitlines() if line.startswith("@@nox@@ ")]
    return lines[-1].removeprefix("@@nox@@ ") if lines else ""


def torch_info(session: Any) -> tuple[str, str | None]:
    """(torch.__version__, torch.version.cuda) of the session's environment."""
    version, cuda = json.loads(py(session, "json.dumps([torch.__version__, torch.version.cuda])", "import json, torch"))
    return version, cuda


def purelib(session: Any) -> Path:
    return Path(py(session, "sysconfig.get_paths()['purelib']", "import sysconfig"))


def install_env(session: Any, m: Matrix, series: str, *extra: str) -> tuple[str, str | None]:
    """torch of a matrix series, the build and test requirements, ``extra``."""
    session.install(f"torch=={m.torches[series].version}", *BUILD_REQS, *TEST_REQS, *extra)
    version, cuda = torch_info(session)
    session.log(f"torch {version} (CUDA {cuda}) for matrix series {series}")
    return version, cuda


def install(session: Any, *args: str) -> None:
    """Install into the session's environment even under ``nox -R``."""
    if getattr(session.virtualenv, "venv_backend", "") == "uv":
        session.run("uv", "pip", "install", *args, external=True, silent=True)
    else:
        session.run("python", "-m", "pip", "install", *args, silent=True)


def install_wheel(session: Any, wheel: Path) -> None:
    install(
        session,
        "--no-deps",
        "--reinstall" if session.virtualenv.venv_backend == "uv" else "--force-reinstall",
        str(wheel),
    )


# -- builds ----------------------------------------------------------------------------


def clean_copy(session: Any, package: str) -> Path:
    """A copy of packages/<package> without build leftovers, in the session's tmp.
    opscommon comes along, so an op's setup.py finds the build helper beside it."""
    root = tmp(session, "src")
    ignore = shutil.ignore_patterns(
        "build",
        "dist",
        "*.egg-info",
        "__pycache__",
        ".pytest_cache",
        ".hypothesis",
        "_runtime.py",
        "*.so",
        "_opscommon",
    )
    for name in {COMMON, package}:
        shutil.copytree(PACKAGES / name, root / name, ignore=ignore)
    return root / package


def build_wheel(session: Any, package: str, dest: Path, *, cuda: bool, env: dict[str, str] | None = None) -> Path:
    """Build one package's wheel (no isolation: against the session's torch)
    from a clean copy; return the wheel, moved into ``dest``."""
    src = clean_copy(session, package)
    out = tmp(session, f"wheel-out/{package}")
    build_env = {"OPS_CUDA": "1" if cuda else "0", **(env or {})}
    start = time.perf_counter()
    log = session.run(
        "python", "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src), env=build_env, silent=True
    )
    (wheel,) = out.glob("*.whl")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{import_name(package)}-*.whl"):
        old.unlink()
    target = dest / wheel.name
    shutil.move(wheel, target)
    chosen = [line.split("] ", 1)[-1] for line in (log or "").splitlines() if "building the" in line]
    session.log(f"built {target.name} in {time.perf_counter() - start:.0f} s" + (f": {chosen[0]}" if chosen else ""))
    return target


def build_and_install(
    session: Any,
    packages: list[str],
    results: Results,
    dest: Path,
    *,
    cuda: bool = False,
    env: dict[str, str] | None = None,
    check: str = "build",
) -> list[str]:
    """opscommon, then each package: build its wheel into ``dest``, install it.
    Returns the packages that built."""
    install_wheel(session, build_wheel(session, COMMON, dest, cuda=False))
    built = []
    for package in packages:
        try:
            install_wheel(session, build_wheel(session, package, dest, cuda=cuda, env=env))
        except (CommandFailed, ValueError) as exc:
            results.add(package, check, "fail", "build failed", str(exc))
            continue
        results.add(package, check, "pass", "built")
        built.append(package)
    return built


def build_sdist(session: Any, package: str, dest: Path) -> Path:
    """``package``'s sdist (an op's carries opscommon's build helper) into ``dest``."""
    before = set(dest.glob("*.tar.gz"))
    session.run(
        "python",
        "-m",
        "build",
        "--sdist",
        "--no-isolation",
        "--outdir",
        str(dest),
        str(clean_copy(session, package)),
        env={"OPS_CUDA": "0"},
        silent=True,
    )
    (sdist,) = set(dest.glob("*.tar.gz")) - before
    return sdist


def build_sdist_in_isolation(session: Any, results: Results, package: str, torch_version: str) -> None:
    """``package``'s sdist, then a wheel from it in an isolated build
    environment (public packages only: setuptools, ninja, torch), installed
    and loaded. torch of the build environment is pinned to the session's
    (a build constraint) so no other torch is downloaded."""
    sdist_dir = tmp(session, "sdist")
    sdist = build_sdist(session, package, sdist_dir)
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    if not any("/_opscommon/opscommon/build.py" in n for n in names):
        results.add(package, "sdist", "fail", "sdist lacks the build helper", sdist.name)
        return
    constraint = sdist_dir / "build-constraints.txt"
    constraint.write_text(f"torch=={torch_version.split('+')[0]}\n")
    out = tmp(session, "sdist-wheel")
    log = (
        session.run(
            "uv",
            "build",
            "--wheel",
            "--build-constraint",
            str(constraint),
            "--out-dir",
            str(out),
            str(sdist),
            env={"OPS_CUDA": "0"},
            external=True,
            silent=True,
        )
        or ""
    )
    (wheel,) = out.glob("*.whl")
    install_wheel(session, wheel)
    line = next((ln for ln in log.splitlines() if "building the" in ln), "")
    ok = check_load(session, results, package, "cpu", "sdist: isolated build")
    if ok:
        session.log(f"{sdist.name} -> {wheel.name} in an isolated environment: {line.strip()}")


# -- tests -----------------------------------------------------------------------------


def junit_counts(path: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return counts
    for suite in root.iter("testsuite"):
        tests = int(suite.get("tests", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        counts["passed"] += tests - failed - skipped
        counts["failed"] += failed
        counts["skipped"] += skipped
    return counts


def test_suites(built: list[str], chosen: list[str] | None) -> list[tuple[str, Path]]:
    """(name, tests folder): tools, opscommon, the built op packages, then
    tests/integration; ``chosen`` limits them (None: all)."""
    suites = [("tools", ROOT / "tools" / "tests"), (COMMON, PACKAGES / COMMON / "tests")]
    suites += [(p, PACKAGES / p / "tests") for p in built]
    suites.append(("integration", ROOT / "tests" / "integration"))
    return [
        (name, path)
        for name, path in suites
        if path.is_dir() and any(path.rglob("test_*.py")) and (chosen is None or name in chosen)
    ]


def run_pytest(
    session: Any,
    results: Results,
    suite: str,
    tests: Path,
    check: str,
    pytest_args: list[str] = (),
    *,
    python: str | None = None,
    env: dict[str, str] | None = None,
    require_a_pass: bool | None = None,
    timed: bool = False,
) -> bool:
    """One test suite, from outside the source tree (so the installed package
    is the one imported); its counts go into ``results``. ``python``: another
    interpreter than the session's (an emulated or free-threaded one), run
    with ``env``. ``require_a_pass``: a run with no test passed fails
    (default: unless ``pytest_args`` narrow the suite). ``timed``: the
    result's text ends with the seconds it took."""
    junit = tmp(session, "junit/" + re.sub(r"[^\w.-]+", "-", f"{check}-{suite}")) / "junit.xml"
    if require_a_pass is None:
        require_a_pass = not pytest_args
    ok = True
    start = time.perf_counter()
    with session.chdir(tmp(session, "run")):
        try:
            session.run(
                python or "python",
                "-m",
                "pytest",
                "-q",
                "-ra",
                "-p",
                "no:cacheprovider",
                f"--junitxml={junit}",
                str(tests),
                *pytest_args,
                **({"env": env, "external": True} if python else {}),
            )
        except CommandFailed:
            ok = False
    counts = junit_counts(junit)
    text = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if ok and counts["passed"] == 0 and require_a_pass:
        ok, text = False, "no test passed: " + text
    if timed:
        text += f" in {time.perf_counter() - start:.0f} s"
    results.add(suite, check, "pass" if ok else "fail", text, counts=counts)
    return ok


def run_suites(
    session: Any, results: Results, built: list[str], chosen: list[str] | None, check: str, pytest_args: list[str] = ()
) -> None:
    for suite, tests in test_suites(built, chosen):
        run_pytest(session, results, suite, tests, check, pytest_args)


def check_load(session: Any, results: Results, package: str, expect: str, check: str) -> bool:
    """scripts/check_load.py in the session: loads with the kernels ``expect``
    says ("cpu", "cuda"), or refuses cleanly ("refused")."""
    out = tmp(session, "check-load") / "result.json"
    try:
        session.run(
            "python", str(SCRIPTS / "check_load.py"), import_name(package), "--expect", expect, "--json", str(out)
        )
    except CommandFailed:
        pass
    try:
        r = json.loads(out.read_text())
    except (OSError, ValueError):
        r = {"status": "fail", "detail": "check_load.py did not finish (crash at import?)"}
    text = {"cuda": "CUDA kernels loaded", "refused": "refused to load", "cpu": "loaded"}[expect]
    results.add(package, check, r["status"], text if r["status"] == "pass" else "FAILED", r["detail"])
    return r["status"] == "pass"


# -- CUDA --------------------------------------------------------------------------------


def toolkit_home(session: Any, tk: Toolkit) -> tuple[Path | None, str]:
    """CUDA_HOME of a toolkit for this session (``toolkits.requirements(tk)``
    installed in its environment first, for a PyPI toolkit)."""
    return toolkits.locate(tk, purelib(session) if tk.source == "pypi" else None, CACHE / "toolkits")


def pip_download(session: Any, folder: str, requirements: list[str], extra_args: list[str] = ()) -> Path:
    """Binary wheels of ``requirements`` (no dependencies) downloaded by the
    session's pip into its temporary ``folder``; ``extra_args`` choose the
    platform and Python. Returns the folder."""
    session.install("pip")
    download = tmp(session, folder)
    session.run(
        "python",
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        *extra_args,
        "-d",
        str(download),
        *requirements,
    )
    return download


def torch_headers(session: Any, version: str) -> Path:
    """A folder holding torch/include of a torch release, unpacked from its
    wheel (downloaded once, only the headers kept)."""
    dest = CACHE / f"torch-{version}-headers"
    if (dest / "torch" / "include" / "torch" / "csrc" / "stable").is_dir():
        return dest
    download = pip_download(session, "torch-wheel", [f"torch=={version}"])
    (wheel,) = download.glob("torch-*.whl")
    staging = tmp(session, "torch-headers")
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.startswith("torch/include/") or n == "torch/utils/cpp_extension.py"]
        zf.extractall(staging, members)
    shutil.rmtree(download)
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.move(staging, dest)
    (dest / "WHEEL").write_text(wheel.name + "\n")
    session.log(f"torch headers of {wheel.name} in {dest}")
    return dest


def pip_platforms(tag: str) -> list[str]:
    """``--platform`` options of ``pip download`` that accept every wheel
    installable on ``tag`` ("manylinux_2_28_aarch64": manylinux 2.17 to 2.28,
    manylinux2014, linux; pip matches the names given, no older ones)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
    if not m:
        return ["--platform", tag]
    top, machine = int(m.group(1)), m.group(2)
    names = [f"manylinux_2_{minor}_{machine}" for minor in range(top, 16, -1)]
    names += [f"manylinux2014_{machine}", f"linux_{machine}"]
    return [arg for name in names for arg in ("--platform", name)]


def target_torch(session: Any, version: str, tag: str, python: str) -> Path:
    """The ``torch`` folder of PyPI's torch wheel ``version`` for platform
    ``tag`` (CPython ``python``), unpacked once into the cache with what a
    build needs: headers, ``version.py`` and the libraries an extension links
    (libc10, libtorch, libtorch_cpu; libc10_cuda, libtorch_cuda for CUDA)."""
    dest = CACHE / f"torch-{version}-{tag}"
    root = dest / "torch"
    if (root / "lib" / "libtorch_cpu.so").is_file() and (root / "include" / "torch" / "csrc" / "stable").is_dir():
        return root
    start = time.perf_counter()
    download = pip_download(
        session, "torch-target-wheel", [f"torch=={version}"], [*pip_platforms(tag), "--python-version", python]
    )
    (wheel,) = download.glob("torch-*.whl")
    libs = {
        f"torch/lib/{n}" for n in ("libc10.so", "libtorch.so", "libtorch_cpu.so", "libc10_cuda.so", "libtorch_cuda.so")
    }
    staging = tmp(session, "torch-target")
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.startswith("torch/include/") or n in libs or n == "torch/version.py"]
        zf.extractall(staging, members)
    size = wheel.stat().st_size
    shutil.rmtree(download)
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.move(staging, dest)
    (dest / "WHEEL").write_text(wheel.name + "\n")
    session.log(
        f"{wheel.name} ({size / 2**20:.0f} MiB) in {time.perf_counter() - start:.0f} s: headers and libraries in {root}"
    )
    return root


def cross_build_env(plat: Platform, torch_root: Path) -> dict[str, str]:
    """Environment of a build for ``plat`` on this machine (opscommon.build's
    cross-compilation: its compiler, the target torch, the wheel platform)."""
    cc, cxx = f"{plat.cross_prefix}gcc", f"{plat.cross_prefix}g++"
    return {
        "OPS_CROSS_TORCH": str(torch_root),
        "OPS_CROSS_PLAT": plat.plat_name,
        "CC": cc,
        "CXX": cxx,
        # setuptools links with these (the build machine's Python's would say gcc)
        "LDSHARED": f"{cxx} -shared",
        "LDCXXSHARED": f"{cxx} -shared",
    }


def cross_cuda_home(session: Any, tk: Toolkit, plat: Platform, host_home: Path) -> Path:
    """A CUDA_HOME for cross-compiling ``tk``'s variant for ``plat``: the
    build machine's toolkit ``host_home`` runs (``bin/``: nvcc, ptxas...,
    ``nvvm/``: cicc compile the device code, which does not depend on the
    CPU), while ``include/`` and ``lib/`` (libcudart) are the target CPU's,
    from the toolkit's pinned PyPI wheels for ``plat`` (downloaded once into
    the cache; headers and libraries only). nvcc looks for them under
    ``targets/<cpu>-linux/`` when its host compiler is for another CPU, and
    torch's build under ``include/`` and ``lib/``: the folder has both."""
    if tk.source != "pypi":
        raise ValueError(f"CUDA {tk.version} comes from {tk.source}: {plat.name}'s target files come from PyPI wheels")
    nvcc = host_home / "bin" / "nvcc"
    if not nvcc.is_file() or nvcc.read_bytes()[:4] != b"\x7fELF":
        # nvcc finds its files (and targets/) from where it runs: a wrapper
        # script that starts one elsewhere would look there instead
        raise ValueError(f"{nvcc} is not the nvcc program itself (a wrapper script?): use the toolkit's own folder")
    files = CACHE / f"cuda-{tk.version}-{plat.wheel_tag}"
    if not (files / ".complete").is_file():
        shutil.rmtree(files, ignore_errors=True)
        download = pip_download(session, "cuda-target-wheels", list(tk.requirements), pip_platforms(plat.wheel_tag))
        staging = tmp(session, "cuda-target")
        prefix = (tk.home or "").rstrip("/") + "/"
        for wheel in sorted(download.glob("*.whl")):
            with zipfile.ZipFile(wheel) as zf:
                members = [n for n in zf.namelist() if n.startswith((prefix + "include/", prefix + "lib/"))]
                zf.extractall(staging, members)
        CACHE.mkdir(parents=True, exist_ok=True)
        shutil.move(staging / (tk.home or ""), files)
        (files / ".complete").write_text("\n".join(p.name for p in sorted(download.glob("*.whl"))) + "\n")
        session.log(f"CUDA {tk.version} headers and libraries for {plat.name} in {files}")
    home = tmp(session, f"cuda-{tk.version}-{plat.name}-home")
    (home / "bin").mkdir(parents=True)
    for tool in sorted((host_home / "bin").iterdir()):  # a real bin/: nvcc finds the rest from it
        (home / "bin" / tool.name).symlink_to(tool.resolve())
    (home / "nvvm").symlink_to((host_home / "nvvm").resolve())
    (home / "include").symlink_to(files / "include")
    (home / "lib").mkdir()
    for lib in sorted((files / "lib").iterdir()):
        (home / "lib" / lib.name).symlink_to(lib)
    runtime = sorted((files / "lib").glob("libcudart.so.*"))
    if runtime and not (home / "lib" / "libcudart.so").exists():
        (home / "lib" / "libcudart.so").symlink_to(runtime[0].name)  # the name the linker looks for
    (home / "targets").mkdir()
    (home / "targets" / f"{plat.name}-linux").symlink_to("..")
    if plat.name == "aarch64":  # the server (SBSA) name nvcc's own cross packages use
        (home / "targets" / "sbsa-linux").symlink_to("..")
    return home


def cross_compiler_missing(plat: Platform) -> str | None:
    """Why ``plat``'s cross compiler cannot be used here, or None."""
    cxx = f"{plat.cross_prefix}g++"
    if shutil.which(cxx) is None:
        how = f" (Debian/Ubuntu: apt-get install {plat.compiler_package})" if plat.compiler_package else ""
        return f"{cxx} is not installed{how}"
    return None


def cuda_compile_check(session: Any, results: Results, m: Matrix, packages: list[str], tk: Toolkit) -> None:
    """Compile (no GPU, no CUDA torch installed) every C++/CUDA source of the
    packages for the CUDA variant with toolkit ``tk``, against the headers of
    its torch, for its arch list. Needs opscommon installed."""
    check = f"nvcc {tk.version} compile"
    home, reason = toolkit_home(session, tk)
    if home is None:
        for package in packages:
            results.add(package, check, "skip", "no toolkit", reason)
        if tk.source == "pypi":  # the PyPI toolkit must work: not a skip
            session.error(reason)
        return
    torch_version = m.torches[tk.torch].version
    headers = torch_headers(session, torch_version)
    out = tmp(session, "cuda-compile") / "results.json"
    try:
        session.run(
            "python",
            str(SCRIPTS / "cuda_compile.py"),
            "--cuda-home",
            str(home),
            "--torch-root",
            str(headers),
            "--arch-list",
            tk.arch_list,
            "--build-dir",
            str(tmp(session, "cuda-build")),
            "--json",
            str(out),
            *[str(PACKAGES / p) for p in packages],
        )
    except CommandFailed:
        pass
    try:
        per_package = json.loads(out.read_text())
    except (OSError, ValueError):
        per_package = {}
    for package in packages:
        r = per_package.get(package, {"status": "fail", "detail": "cuda_compile.py did not finish"})
        text = {"pass": "compiled", "fail": "FAILED", "skip": "no CUDA sources"}[r["status"]]
        results.add(
            package, check, r["status"], text, f"{r['detail']}; torch {torch_version} headers, archs {tk.arch_list}"
        )


def cuda_build_env(home: Path, tk: Toolkit) -> dict[str, str]:
    """Environment of a CUDA build with toolkit ``tk`` at ``home`` (its arch
    list unless TORCH_CUDA_ARCH_LIST is set; its nvcc first on PATH)."""
    env = {
        **toolkits.build_env(tk, home),
        "PATH": f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        env["TORCH_CUDA_ARCH_LIST"] = os.environ["TORCH_CUDA_ARCH_LIST"]
    return env
