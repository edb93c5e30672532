"""The longer session bodies: building a wheel variant, releasing it into its
index, and one torch release of the support matrix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from . import steps, toolkits, wheels
from .matrix import Matrix, Platform
from .packages import COMMON, import_name, op_packages
from .results import Results

MATRIX_WHEELS = steps.ROOT / ".nox" / "_matrix-wheels"  # wheels the matrix installs into every torch
# AOTInductor packages (.pt2) that each torch release of the matrix makes with
# the CPU matrix wheels (scripts/deploy_across.py export), one folder per
# series: every later release runs them. Emptied with the CPU wheels.
MATRIX_PT2 = steps.ROOT / ".nox" / "_matrix-pt2"
DEPLOY_ACROSS = steps.SCRIPTS / "deploy_across.py"


def build_variant(
    session: Any, m: Matrix, variant: str, packages: list[str], results: Results, dest: Path, check: str, *extra: str
) -> tuple[str, list[str]]:
    """Install the variant's torch (and toolkit), build every package's wheel
    of that variant into ``dest``; (torch version, packages built).
    A toolkit that cannot be had here skips the session, with the reason."""
    if variant == "cpu":
        version, _ = steps.install_env(session, m, m.cpu_wheel_torch, *extra)
        return version, steps.build_and_install(session, packages, results, dest, check=check)
    tk = m.toolkit_of_variant(variant)
    if tk.source != "pypi":  # a fetched or system toolkit: before the torch download
        home, reason = steps.toolkit_home(session, tk)
        if home is None:
            for package in packages:
                results.add(package, check, "skip", "no toolkit", reason)
            results.finish()
            session.skip(reason)
    version, cuda = steps.install_env(session, m, tk.torch, *toolkits.requirements(tk), *extra)
    home, reason = steps.toolkit_home(session, tk)
    if home is None:
        session.error(reason)
    if cuda is None or cuda.split(".")[0] != tk.major:
        session.error(
            f"torch {version} is not a CUDA {tk.major} build (CUDA {cuda}): "
            f"cannot build the {variant} wheels against it"
        )
    built = steps.build_and_install(
        session, packages, results, dest, cuda=True, env=steps.cuda_build_env(home, tk), check=check
    )
    return version, built


def build_cross(
    session: Any, m: Matrix, plat: Platform, variant: str, packages: list[str], results: Results, dest: Path, check: str
) -> list[str]:
    """Cross-compile every package's ``variant`` wheel for ``plat`` into
    ``dest`` (the session has the build machine's torch, which runs the build;
    the binaries compile against PyPI's torch wheel for ``plat``; a CUDA
    variant with this machine's nvcc and the target CPU's CUDA files, see
    steps.cross_cuda_home). Returns the packages built; without the cross
    compiler each is a skip, with the reason."""
    missing = steps.cross_compiler_missing(plat)
    if missing:
        for package in packages:
            results.add(package, check, "skip", "no cross compiler", missing)
        return []
    if variant not in plat.variants:
        raise ValueError(f"{variant} is not built for {plat.name}: only {', '.join(plat.variants)}")
    torch_root = steps.target_torch(session, m.torches[plat.torch].version, plat.wheel_tag, m.default_python)
    steps.install_wheel(session, steps.build_wheel(session, COMMON, dest, cuda=False))
    env = steps.cross_build_env(plat, torch_root)
    cuda = variant != "cpu"
    if cuda:  # nvcc of this machine, the target CPU's CUDA headers and libcudart (steps.cross_cuda_home)
        tk = m.toolkit_of_variant(variant)
        session.install(*toolkits.requirements(tk))
        host, reason = steps.toolkit_home(session, tk)
        if host is None:
            session.error(reason)
        home = steps.cross_cuda_home(session, tk, plat, host)
        env.update(
            CUDA_HOME=str(home),
            TORCH_CUDA_ARCH_LIST=os.environ.get("TORCH_CUDA_ARCH_LIST") or tk.arch_list,
            PATH=f"{home / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        )
    built = []
    for package in packages:
        try:
            wheel = steps.build_wheel(session, package, dest, cuda=cuda, env=env)
        except (steps.CommandFailed, ValueError) as exc:
            results.add(package, check, "fail", "build failed", str(exc))
            continue
        results.add(package, check, "pass", "built", wheel.name)
        built.append(package)
    return built


def release(
    session: Any, results: Results, built: list[str], work: Path, dest: Path, variant: str, tag: str = wheels.PLATFORM
) -> None:
    """Repair and audit each op wheel built in ``work`` into ``dest`` (the
    variant's index folder, shared by every CPU: only wheels of ``tag``'s CPU
    are replaced), then write its PEP 503 index."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"*_{wheels.machine_of(tag)}.whl"):
        old.unlink()
    for package in built:
        (wheel,) = work.glob(f"{import_name(package)}-*.whl")
        try:
            fixed = wheels.repair(session, wheel, dest, tag)
        except (steps.CommandFailed, ValueError) as exc:  # auditwheel refused: the binary is not portable
            results.add(package, f"{variant}: manylinux", "fail", "auditwheel repair refused", str(exc))
            continue
        wheels.audit(session, results, fixed, package, f"{variant}: manylinux", tag)
    index = wheels.write_index(dest)
    session.log(f"{variant} index {index}: " + ", ".join(sorted(p.name for p in dest.glob("*.whl"))))


def matrix_wheel(variant: str, package: str) -> Path | None:
    found = sorted((MATRIX_WHEELS / variant).glob(f"{import_name(package)}-*.whl"))
    return found[-1] if found else None


def matrix_wheels(session: Any, m: Matrix, variant: str) -> None:
    """The wheels of one variant that the matrix installs into every torch."""
    dest = MATRIX_WHEELS / variant
    shutil.rmtree(dest, ignore_errors=True)
    if variant == "cpu":
        shutil.rmtree(MATRIX_PT2, ignore_errors=True)
    results = Results(session, "wheels", row=variant, label=f"{variant} wheels")
    check = f"{variant} wheel: build"
    version, built = build_variant(session, m, variant, op_packages(), results, dest, check)
    if variant != "cpu":
        for package in built:
            steps.check_load(session, results, package, "cuda", f"{variant} wheel: load")
    results.data["label"] = f"{variant} wheels (torch {version})"
    (dest / "BUILT.json").write_text(json.dumps({"torch": version, "variant": variant, "time": time.time()}))
    results.finish()


def matrix_torch(session: Any, m: Matrix, series: str, source_tests: bool) -> None:
    """One torch release: (a) the matrix wheels, built once: every test suite
    with the CPU wheels; each CUDA wheel loads with its CUDA kernels in a
    torch of its CUDA major and refuses cleanly elsewhere; (b) every package
    built from source against this torch (CPU; CUDA where a toolkit of this
    torch's CUDA major is at hand) loads with its kernels."""
    if not (MATRIX_WHEELS / "cpu" / "BUILT.json").exists():
        session.error("no matrix wheels: run `nox -s matrix_wheels` first (or `nox -t matrix`)")
    packages = op_packages()
    release_ = m.torches[series]
    candidates = m.toolkits_for_cuda(release_.cuda) if release_.cuda_major else []
    pypi = [tk for tk in candidates if tk.source == "pypi"]
    version, cuda = steps.install_env(session, m, series, *(toolkits.requirements(pypi[0]) if pypi else []))
    label = f"torch {version} ({'CUDA ' + cuda if cuda else 'CPU build'})"
    results = Results(session, "matrix", row=series, label=label)

    # (a) binary compatibility: the same wheels in every torch.
    steps.install_wheel(session, matrix_wheel("cpu", COMMON))
    installed = []
    for package in packages:
        wheel = matrix_wheel("cpu", package)
        if wheel is None:
            results.add(package, "cpu wheel: tests", "fail", "no wheel", "matrix_wheels did not build it")
            continue
        steps.install_wheel(session, wheel)
        installed.append(package)
    steps.run_suites(session, results, installed, [COMMON, *installed, "integration"], "cpu wheel: tests")
    _deploy_across_releases(session, m, results, series, installed)
    for variant in m.variants[1:]:
        if not (MATRIX_WHEELS / variant / "BUILT.json").exists():
            continue  # matrix_wheels said why (no such toolkit here)
        wheel_major = m.toolkit_of_variant(variant).major
        for package in packages:
            wheel = matrix_wheel(variant, package)
            if wheel is None:
                results.add(package, f"{variant} wheel: load", "skip", "not built", f"no {variant} wheel")
                continue
            steps.install_wheel(session, wheel)
            expect = "cuda" if cuda and cuda.split(".")[0] == wheel_major else "refused"
            steps.check_load(session, results, package, expect, f"{variant} wheel: load")

    # (b) source builds against this torch.
    built = steps.build_and_install(
        session, packages, results, steps.tmp(session, "source-wheels"), check="source: build"
    )
    if source_tests:
        steps.run_suites(session, results, built, built, "source: tests")
    else:  # the same sources' tests ran in (a); here: loads and registers its kernels
        for package in built:
            steps.check_load(session, results, package, "cpu", "source: load")
    _source_cuda(session, m, results, packages, cuda, label)
    results.finish()


def _deploy_across_releases(session: Any, m: Matrix, results: Results, series: str, installed: list[str]) -> None:
    """The deployed artifact's side of the stable ABI: this release exports
    every op's deployment model into MATRIX_PT2/<series> with the CPU matrix
    wheels; the packages that earlier releases of the matrix made there run
    here, in a fresh Python and with the C++ runner built against this
    release's libtorch (scripts/deploy_across.py, as `nox -s deploy_across`)."""
    out = MATRIX_PT2 / series
    shutil.rmtree(out, ignore_errors=True)
    try:
        session.run("python", str(DEPLOY_ACROSS), "export", str(out), *installed)
    except steps.CommandFailed as exc:
        for package in installed:
            results.add(package, "cpu wheel: export .pt2", "fail", "export failed", str(exc))
    earlier = [s for s in list(m.torches)[: list(m.torches).index(series)] if any((MATRIX_PT2 / s).glob("*/model.pt2"))]
    if not earlier:
        for package in installed:
            results.add(
                package, "cpu wheel: .pt2 of earlier torch", "skip", "none yet", f"no .pt2 of a torch before {series}"
            )
        return
    for old in earlier:
        report = steps.tmp(session, f"deploy-across-{old}") / "results.json"
        try:
            session.run("python", str(DEPLOY_ACROSS), "run", str(MATRIX_PT2 / old), "--json", str(report))
        except steps.CommandFailed:
            pass  # the report says which package failed
        try:
            items = json.loads(report.read_text())
        except (OSError, ValueError):
            items = [
                {"module": import_name(p), "status": "fail", "detail": "deploy_across.py run did not finish"}
                for p in installed
            ]
        for item in items:
            package = item["module"].replace("_", "-")
            results.add(package, f"cpu wheel: .pt2 of torch {old}", item["status"], item["status"], item["detail"])


def _source_cuda(session: Any, m: Matrix, results: Results, packages: list[str], cuda: str | None, label: str) -> None:
    check = "source: CUDA build"
    if cuda is None:
        for package in packages:
            results.add(package, check, "skip", "CPU torch", f"{label} has no CUDA")
        return
    home, reason, tk = None, f"no CUDA {cuda.split('.')[0]} toolkit in matrix.toml for {label}", None
    for tk in m.toolkits_for_cuda(cuda):
        home, reason = steps.toolkit_home(session, tk)
        if home is not None:
            break
    if home is None:
        for package in packages:
            results.add(package, check, "skip", "no toolkit", reason)
        return
    built = steps.build_and_install(
        session,
        packages,
        results,
        steps.tmp(session, "source-cuda-wheels"),
        cuda=True,
        env=steps.cuda_build_env(home, tk),
        check=check,
    )
    for package in built:
        steps.check_load(session, results, package, "cuda", "source: CUDA load")


def target_site(session: Any, m: Matrix, plat: Platform) -> Path:
    """A folder (for PYTHONPATH) with PyPI's torch of ``plat.torch`` for
    ``plat`` and its dependencies (for aarch64: the CUDA 13 libraries that
    torch's aarch64 wheel links, about 4 GB), and the test requirements,
    installed once into the cache."""
    version = m.torches[plat.torch].version
    python = plat.test["python"]
    site = steps.CACHE / f"site-{plat.name}-cp{python.replace('.', '')}-torch-{version}"
    done = site / ".complete"
    if done.is_file():
        return site
    shutil.rmtree(site, ignore_errors=True)
    session.install("pip")
    start = time.perf_counter()
    session.run(
        "python",
        "-m",
        "pip",
        "install",
        "--quiet",
        "--target",
        str(site),
        "--only-binary=:all:",
        *steps.pip_platforms(plat.wheel_tag),
        "--python-version",
        python,
        "--implementation",
        "cp",
        f"torch=={version}",
        *steps.TEST_REQS,
    )
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file()) / 2**30
    took = time.perf_counter() - start
    session.log(f"torch {version} for {plat.name} and the test requirements in {site}: {size:.1f} GiB in {took:.0f} s")
    done.write_text(f"torch=={version}\n")
    return site


# Tests that cannot run emulated here (a pytest -k expression): Inductor's
# CPU code generation, for torch.compile and for AOTInductor's .pt2 packages
# (the deployment tests), compiles C++ for the interpreter's CPU at run time,
# which needs an aarch64 compiler inside the emulated system (and its Python
# headers); the host's g++ refuses the aarch64 flags.
EMULATED_DESELECT = "compile or deploy"


def emulated_tests(session: Any, m: Matrix, plat: Platform, packages: list[str], pytest_args: list[str]) -> None:
    """The platform's wheels, cross-compiled here, and its torch from PyPI, in
    an emulated CPython of that CPU: every op package's test suite (less
    what :data:`EMULATED_DESELECT` names); then its CUDA wheels load there
    with their CUDA kernels. Skipped, with the reason, where the emulator,
    the cross compiler or the packages cannot be had."""
    from . import emulated

    results = Results(session, "emulated", row=plat.name, label=f"{plat.name} wheels under {plat.test.get('emulator')}")
    reason = emulated.emulator_missing(plat.test) or steps.cross_compiler_missing(plat)
    if reason:
        for package in packages:
            results.add(package, f"{plat.name}: tests", "skip", "cannot run here", reason)
        results.finish()
        session.skip(reason)
    steps.install_env(session, m, m.cpu_wheel_torch)
    work = steps.tmp(session, f"built-cpu-{plat.name}")
    built = build_cross(session, m, plat, "cpu", packages, results, work, f"{plat.name}: build")
    try:
        python = emulated.sysroot(plat.test, steps.CACHE, os.cpu_count() or 1, session.log)
    except emulated.EmulationUnavailable as exc:
        for package in built:
            results.add(package, f"{plat.name}: tests", "skip", "no emulated Python", str(exc))
        results.finish()
        session.skip(str(exc))
    site = target_site(session, m, plat)
    ops = steps.tmp(session, f"site-ops-{plat.name}")
    session.install("pip")  # for --target and --platform (target_site installs it only on a cold cache)
    session.run(
        "python",
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--target",
        str(ops),
        *steps.pip_platforms(plat.wheel_tag),
        "--python-version",
        plat.test["python"],
        "--only-binary=:all:",
        *map(str, sorted(work.glob("*.whl"))),
    )
    env = {"PYTHONPATH": f"{ops}{os.pathsep}{site}"}
    for package in built:
        steps.run_pytest(
            session,
            results,
            package,
            steps.PACKAGES / package / "tests",
            f"{plat.name}: tests",
            ["-k", f"not ({EMULATED_DESELECT})", *pytest_args],
            python=str(python),
            env=env,
            require_a_pass=True,
            timed=True,
        )
    for variant in [v for v in plat.variants if v != "cpu"]:
        _emulated_cuda_load(session, m, plat, variant, built, python, site, results)
    results.finish()


def _emulated_cuda_load(
    session: Any, m: Matrix, plat: Platform, variant: str, packages: list[str], python: Path, site: Path, r: Results
) -> None:
    """The platform's CUDA wheels, cross-compiled, load in its torch (a CUDA
    build) under the emulator and register their CUDA kernels (no GPU is
    needed for that; running them needs one: not here)."""
    work = steps.tmp(session, f"built-{variant}-{plat.name}")
    built = build_cross(session, m, plat, variant, packages, r, work, f"{plat.name} {variant}: build")
    ops = steps.tmp(session, f"site-ops-{variant}-{plat.name}")
    session.run(
        "python",
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--target",
        str(ops),
        *steps.pip_platforms(plat.wheel_tag),
        "--python-version",
        plat.test["python"],
        "--only-binary=:all:",
        *map(str, sorted(work.glob("*.whl"))),
    )
    env = {"PYTHONPATH": f"{ops}{os.pathsep}{site}"}
    for package in built:
        out = steps.tmp(session, f"check-load-{variant}-{package}") / "result.json"
        with session.chdir(steps.tmp(session, "run")):
            try:
                session.run(
                    str(python),
                    str(steps.SCRIPTS / "check_load.py"),
                    import_name(package),
                    "--expect",
                    "cuda",
                    "--json",
                    str(out),
                    env=env,
                    external=True,
                )
            except steps.CommandFailed:
                pass
        try:
            res = json.loads(out.read_text())
        except (OSError, ValueError):
            res = {"status": "fail", "detail": "check_load.py did not finish (crash at import?)"}
        text = "CUDA kernels loaded (not run: no GPU)" if res["status"] == "pass" else "FAILED"
        r.add(package, f"{plat.name} {variant}: load", res["status"], text, res["detail"])


def _uv() -> str | None:
    """uv's executable: on PATH, or the one installed with nox (its uv backend)."""
    found = shutil.which("uv")
    if found:
        return found
    try:
        import uv  # the `uv` package beside nox

        return uv.find_uv_bin()
    except (ImportError, FileNotFoundError):
        return None


def _install_for(session: Any, python: Path, target: Path, *args: str) -> None:
    """pip install --target for the interpreter ``python`` (its tags decide
    what installs): with uv where it is, else with that interpreter's pip."""
    uv = _uv()
    if uv:
        cmd = [uv, "pip", "install", "--quiet", "--python", str(python), "--target", str(target), *args]
    else:  # the interpreter's own pip (tools.freethreaded's build installs one)
        cmd = [str(python), "-m", "pip", "install", "--quiet", "--target", str(target), *args]
    session.run(*cmd, external=True)


def freethreaded_site(session: Any, m: Matrix, python: Path) -> Path:
    """A folder (for PYTHONPATH) with PyPI's free-threaded torch of
    ``[python.freethreaded] torch`` and the test requirements for the
    interpreter ``python``, installed once into the cache (wheels only: an
    sdist would have to build for the free-threaded ABI)."""
    version = m.torches[m.freethreaded["torch"]].version
    abi = "cp" + m.freethreaded["version"].replace(".", "") + "t"
    site = steps.CACHE / f"site-{abi}-torch-{version}"
    done = site / ".complete"
    if done.is_file():
        return site
    shutil.rmtree(site, ignore_errors=True)
    start = time.perf_counter()
    _install_for(session, python, site, "--only-binary=:all:", f"torch=={version}", *steps.TEST_REQS)
    size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file()) / 2**30
    took = time.perf_counter() - start
    session.log(f"torch {version} ({abi}) and the test requirements in {site}: {size:.1f} GiB in {took:.0f} s")
    done.write_text(f"torch=={version}\n")
    return site


def freethreaded_tests(session: Any, m: Matrix, packages: list[str], pytest_args: list[str]) -> None:
    """The CPU release wheels (py3-none, repaired and checked as `nox -s
    build` does) in a free-threaded CPython with PyPI's free-threaded torch:
    importing each op package keeps the GIL off, then every op package's
    test suite runs with the GIL off. Skipped, with the reason, where no
    free-threaded interpreter can be had (tools/freethreaded.py)."""
    from . import freethreaded

    ft = m.freethreaded
    tag = f"{ft.get('version', '?')}t"
    results = Results(session, "freethreaded", row=tag, label=f"CPU wheels on free-threaded CPython {tag}")
    try:
        python = freethreaded.interpreter(ft, steps.CACHE, os.cpu_count() or 1, session.log)
    except freethreaded.Unavailable as exc:
        for package in packages:
            results.add(package, f"{tag}: tests", "skip", "no free-threaded CPython", str(exc))
        results.finish()
        session.skip(str(exc))
    work = steps.tmp(session, "built-cpu")
    _, built = build_variant(session, m, "cpu", packages, results, work, "cpu: build", *wheels.AUDIT_TOOLS)
    dist = steps.tmp(session, "dist-cpu")
    release(session, results, built, work, dist, "cpu")
    site = freethreaded_site(session, m, python)
    ops = steps.tmp(session, "site-ops")
    # the interpreter's installer accepts the py3-none wheels (an abi3 one it refuses)
    wheels_ = [*sorted(work.glob("opscommon-*.whl")), *sorted(dist.glob("*.whl"))]
    _install_for(session, python, ops, "--no-deps", *map(str, wheels_))
    env = {"PYTHONPATH": f"{ops}{os.pathsep}{site}"}
    installed = [p for p in built if any(dist.glob(f"{import_name(p)}-*.whl"))]
    # A module that does not declare itself free-threading safe turns the GIL
    # back on when it is loaded (with a RuntimeWarning naming it). The op
    # libraries are not Python modules; what importing each package loads is
    # checked here, in a fresh interpreter each.
    for package in installed:
        gil = (
            "import sys, warnings; warnings.simplefilter('error', RuntimeWarning); import torch\n"
            f"try:\n    import {import_name(package)}\n"
            "except RuntimeWarning as w:\n    sys.exit(f'GIL enabled: {w}')\n"
            "print(sys.version.split()[0], 'GIL enabled' if sys._is_gil_enabled() else 'GIL disabled')\n"
            "sys.exit(sys._is_gil_enabled())"
        )
        check = f"{tag}: import keeps the GIL off"
        out = subprocess.run([str(python), "-c", gil], env={**os.environ, **env}, capture_output=True, text=True)
        said = (out.stdout + out.stderr).strip().splitlines() or ["(no output)"]
        if out.returncode == 0:
            results.add(package, check, "pass", said[-1], f"import torch, {import_name(package)}")
        else:
            results.add(package, check, "fail", "importing it enables the GIL (or fails)", said[-1])
    # The suites run with the GIL off whatever a module of torch's declares
    # (PYTHON_GIL=0): the threads of the ops' thread-safety tests then really
    # run at once.
    env["PYTHON_GIL"] = "0"
    for package in installed:
        steps.run_pytest(
            session,
            results,
            package,
            steps.PACKAGES / package / "tests",
            f"{tag}: tests",
            list(pytest_args),
            python=str(python),
            env=env,
            require_a_pass=True,
            timed=True,
        )
    results.finish()
