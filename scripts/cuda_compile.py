"""Compile every C++/CUDA source of op packages for the CUDA variant, with no
GPU and no CUDA build of torch installed: compile-only, object files, then a
shared-library link against the CUDA runtime (torch's symbols stay undefined,
as in any extension before it is loaded).

Uses the flags of the real build: ``opscommon.build.compile_flags(cuda=True)``
plus what torch's ``BuildExtension`` adds (read from the ``cpp_extension.py``
next to the headers), the include dirs ``opscommon.get_include()``,
``<package>/csrc`` and torch's, and ``-gencode`` for every entry of the arch
list. ninja drives the compiles (``MAX_JOBS`` parallel jobs), and each nvcc
compiles that many architectures at once (the build helper's ``--threads``).

Run inside an environment where opscommon and ninja are installed:

    python scripts/cuda_compile.py --cuda-home DIR --torch-root DIR \
        [--arch-list '8.0;9.0;10.0+PTX'] [--build-dir DIR] [--json FILE] PACKAGE_DIR...

``--torch-root`` holds ``torch/include`` (an unpacked torch wheel or a
site-packages). Exit status 1 when any package fails to compile.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import opscommon
from opscommon.build import DEFAULT_CUDA_ARCH_LIST, compile_flags, nvcc_threads, validate_arch_list

# torch.utils.cpp_extension.COMMON_NVCC_FLAGS as of torch 2.10-2.14, used when
# the torch tree at hand has no readable cpp_extension.py.
FALLBACK_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
# What torch's BuildExtension defines for every extension it builds.
TORCH_DEFINES = ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"]
NAMED_ARCHES = {
    "Pascal": ["6.0", "6.1"],
    "Volta": ["7.0"],
    "Turing": ["7.5"],
    "Ampere": ["8.0", "8.6"],
    "Ada": ["8.9"],
    "Hopper": ["9.0"],
    "Blackwell": ["10.0", "12.0"],
}


def torch_nvcc_flags(torch_root: Path) -> list[str]:
    """COMMON_NVCC_FLAGS of the torch whose headers we compile against."""
    path = torch_root / "torch" / "utils" / "cpp_extension.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return list(FALLBACK_NVCC_FLAGS)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "COMMON_NVCC_FLAGS" for t in node.targets
        ):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                break
    return list(FALLBACK_NVCC_FLAGS)


def gencode_flags(arch_list: str) -> list[str]:
    """``-gencode`` flags for a TORCH_CUDA_ARCH_LIST value, as torch makes them."""
    flags: list[str] = []
    for entry in validate_arch_list(arch_list):
        ptx = entry.endswith("+PTX")
        base = entry[: -len("+PTX")] if ptx else entry
        for arch in NAMED_ARCHES.get(base, [base]):
            num = arch.replace(".", "")
            flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
            if ptx:
                flags += ["-gencode", f"arch=compute_{num},code=compute_{num}"]
    return flags


def ninja_escape(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def quote(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda-home", required=True, type=Path)
    parser.add_argument("--torch-root", required=True, type=Path)
    parser.add_argument("--arch-list", default=os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCH_LIST)
    parser.add_argument("--build-dir", type=Path, default=Path("build/cuda-compile"))
    parser.add_argument("--json", type=Path, default=None, help="write per-package results here")
    parser.add_argument("packages", nargs="+", type=Path)
    args = parser.parse_args()

    cuda_home = args.cuda_home.resolve()
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.exists():
        print(f"cuda_compile: no nvcc at {nvcc}", file=sys.stderr)
        return 2
    torch_include = args.torch_root.resolve() / "torch" / "include"
    if not (torch_include / "torch" / "csrc" / "stable").is_dir():
        print(f"cuda_compile: {torch_include} holds no torch/csrc/stable headers", file=sys.stderr)
        return 2
    ninja = shutil.which("ninja")
    if ninja is None:
        print("cuda_compile: ninja is not installed (pip install ninja)", file=sys.stderr)
        return 2
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    print(f"cuda_compile: {nvcc} ({version[-1] if version else '?'})")
    print(f"cuda_compile: torch headers {torch_include}, archs {args.arch_list}")

    flags = compile_flags(cuda=True)
    gencode = gencode_flags(args.arch_list)
    torch_includes = [torch_include, torch_include / "torch" / "csrc" / "api" / "include"]
    common_includes = [
        Path(opscommon.get_include()),
        *torch_includes,
        cuda_home / "include",
        Path(sysconfig.get_paths()["include"]),
    ]
    cxx = os.environ.get("CXX", "c++")

    build_dir = args.build_dir.resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {ninja_escape(str(nvcc))}",
        f"cxx = {ninja_escape(cxx)}",
        "rule nvcc",
        "  command = $nvcc $flags -c $in -o $out",
        "  description = NVCC $in",
        "rule cxx",
        "  command = $cxx $flags -c $in -o $out",
        "  description = CXX $in",
        "rule link",
        "  command = $cxx -shared $in -o $out $ldflags",
        "  description = LINK $out",
    ]
    ldflags = quote([f"-L{cuda_home / 'lib'}", "-lcudart"])
    plan: dict[str, dict] = {}
    for pkg_dir in args.packages:
        pkg_dir = pkg_dir.resolve()
        csrc = pkg_dir / "csrc"
        name = pkg_dir.name
        cu = sorted(csrc.rglob("*.cu"))
        cpp = sorted(csrc.rglob("*.cpp"))
        includes = [f"-I{p}" for p in [*common_includes[:1], csrc, *common_includes[1:]]]
        nvcc_flags = quote(
            [
                *torch_nvcc_flags(args.torch_root.resolve()),
                "--compiler-options",
                "-fPIC",
                *flags["nvcc"],
                *TORCH_DEFINES,
                *includes,
                *gencode,
            ]
        )
        cxx_flags = quote([*flags["cxx"], "-fPIC", *TORCH_DEFINES, *includes])
        objects = []
        for src in cu + cpp:
            rel = src.relative_to(pkg_dir)
            obj = build_dir / name / (str(rel) + ".o")
            obj.parent.mkdir(parents=True, exist_ok=True)
            rule = "nvcc" if src.suffix == ".cu" else "cxx"
            lines += [
                f"build {ninja_escape(str(obj))}: {rule} {ninja_escape(str(src))}",
                f"  flags = {nvcc_flags if rule == 'nvcc' else cxx_flags}",
            ]
            objects.append(ninja_escape(str(obj)))
        lib = build_dir / name / "_C.abi3.so"
        if objects:
            lines += [f"build {ninja_escape(str(lib))}: link {' '.join(objects)}", f"  ldflags = {ldflags}"]
        plan[name] = {
            "cu": [str(p.relative_to(pkg_dir)) for p in cu],
            "cpp": [str(p.relative_to(pkg_dir)) for p in cpp],
            "lib": lib,
        }
    (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")

    for stale in build_dir.rglob("_C.abi3.so"):
        stale.unlink()
    # As many compiles as each nvcc's --threads: MAX_JOBS, else the CPU count.
    jobs = str(nvcc_threads())
    start = time.perf_counter()
    proc = subprocess.run([ninja, "-C", str(build_dir), "-k", "0", "-j", jobs])
    elapsed = time.perf_counter() - start

    results = {}
    for name, p in plan.items():
        if not p["cu"]:
            results[name] = {"status": "skip", "detail": "no .cu sources"}
        elif p["lib"].exists():
            results[name] = {
                "status": "pass",
                "detail": f"{len(p['cu'])} .cu + {len(p['cpp'])} .cpp compiled and linked",
            }
        else:
            results[name] = {"status": "fail", "detail": "compile or link failed (see the log above)"}
    for name, r in results.items():
        print(f"cuda_compile: {name}: {r['status']}: {r['detail']}")
    print(f"cuda_compile: ninja took {elapsed:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    failed = proc.returncode != 0 or any(r["status"] == "fail" for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
