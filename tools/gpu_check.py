"""The GPU check: on a machine with a GPU, a CUDA torch, a matching nvcc and
ninja (no network needed), in that machine's own Python:

    python -m tools.gpu_check [PACKAGE ...] [--results DIR] [--no-bench]
    nox -s gpu -- [same arguments]

builds every op package (or those named) from source, CUDA variant required,
against the machine's torch; runs every test suite with the GPU tests; then
every benchmark. Logs and benchmark tables go to --results (bench-results/).
TORCH_CUDA_ARCH_LIST defaults to 9.0 here (the GPU in hand, quick builds).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "tools"

from . import ROOT
from .packages import COMMON, PACKAGES, op_packages


def _run(cmd: list[str], log: Path | None = None, cwd: Path | None = None) -> bool:
    print("$", " ".join(cmd), flush=True)
    if log is None:
        return subprocess.run(cmd, cwd=cwd).returncode == 0
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        f.write(proc.stdout)
    print("\n".join(proc.stdout.splitlines()[-25:]), flush=True)
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("packages", nargs="*", help="op packages (default: every one)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench-results")
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args(argv)
    packages = args.packages or op_packages()
    unknown = sorted(set(packages) - set(op_packages()))
    if unknown:
        parser.error(f"not op packages: {', '.join(unknown)}")
    results = args.results.resolve()
    results.mkdir(parents=True, exist_ok=True)
    os.environ.update(OPS_CUDA="1", PYTHONUNBUFFERED="1")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    py = sys.executable
    _run(
        [
            py,
            "-c",
            "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())",
        ]
    )
    pip = [py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps"]
    if not _run([*pip, str(PACKAGES / COMMON)]):
        return 1
    ok, built = True, []
    for package in packages:
        print(f"=== build {package}", flush=True)
        if _run([*pip, str(PACKAGES / package)], results / f"build-{package}.log"):
            built.append(package)
        else:
            ok = False
    for suite in [COMMON, *built]:
        print(f"=== test {suite}", flush=True)
        ok &= _run(
            [
                py,
                "-X",
                "faulthandler",
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-rs",
                str(PACKAGES / suite / "tests"),
            ],
            results / f"test-{suite}.log",
            cwd=Path("/tmp"),
        )
    if not args.no_bench:
        for package in built:
            for script in sorted((PACKAGES / package / "bench").glob("bench_*.py")):
                print(f"=== bench {script.name}", flush=True)
                ok &= _run([py, str(script), "--out", str(results)], results / f"{script.stem}.txt")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
