"""Deployment checks shared by every op package: a model that calls the op,
exported (``torch.export``) and compiled with AOTInductor into a ``.pt2``
package, then run where it would be deployed:

* :func:`run_in_fresh_python`: a new Python process that imports torch and
  the one op package, and nothing else of this project;
* :func:`run_in_cpp`: the C++ runner (``opscommon/aoti_runner/``, built by
  :func:`build_runner` against the libtorch of the torch wheel), which loads
  the op's library and the package with no Python in the process, and fails
  if libpython is mapped into it.

Inputs and outputs cross the process boundary as ``torch.save`` files of a
list of tensors (``torch::pickle_load`` / ``torch::pickle_save`` in C++).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.jit._pickle

#: The C++ runner's sources (aoti_runner.cpp, CMakeLists.txt).
RUNNER_DIR = Path(__file__).resolve().parent / "aoti_runner"
RUNNER_SOURCE = RUNNER_DIR / "aoti_runner.cpp"


def export_and_package(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...],
    dynamic_shapes: Any,
    package_path: str | os.PathLike,
) -> Path:
    """``torch.export.export`` ``model`` on ``example_inputs`` with
    ``dynamic_shapes``, then compile it with AOTInductor into the ``.pt2``
    package ``package_path``; returns that path."""
    model = model.eval()
    with torch.no_grad():
        exported = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
    out = torch._inductor.aoti_compile_and_package(exported, package_path=os.fspath(package_path))
    return Path(out)


def _save_inputs(inputs: Sequence[torch.Tensor], path: Path) -> None:
    torch.save([t.detach().cpu().contiguous() for t in inputs], path)


_FRESH_PYTHON = r"""
import importlib, sys
import torch
import torch.jit._pickle
import torch.utils._pytree as pytree
module, package, inputs_path, outputs_path, device = sys.argv[1:6]
if module:
    importlib.import_module(module)
inputs = [t.to(device) for t in torch.load(inputs_path, weights_only=True)]
with torch.inference_mode():
    out = torch._inductor.aoti_load_package(package)(*inputs)
leaves = [t.cpu() for t in pytree.tree_leaves(out)]
# What this process imported besides torch: the op package alone (its build
# helper, opscommon, must not be needed at run time).
own = sorted(m for m in sys.modules if "." not in m and (m == "opscommon" or m.endswith("_op")))
if own != ([module] if module else []):
    sys.exit(f"the process imported {own}, expected only [{module!r}]")
torch.save(leaves, outputs_path)
"""


def run_in_fresh_python(
    package: str | os.PathLike,
    module: str,
    inputs: Sequence[torch.Tensor],
    device: str = "cpu",
    workdir: str | os.PathLike | None = None,
) -> list[torch.Tensor]:
    """Load the ``.pt2`` ``package`` with ``torch._inductor.aoti_load_package``
    in a new Python process that imports only torch and the op package
    ``module`` (none if empty), run it on ``inputs`` (moved to ``device``),
    and return its outputs (flattened, on the CPU)."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        src, dst = Path(tmp) / "inputs.pt", Path(tmp) / "outputs.pt"
        _save_inputs(inputs, src)
        cmd = [sys.executable, "-c", _FRESH_PYTHON, module, os.fspath(package), str(src), str(dst), device]
        # Not the repository's checkout on sys.path: the installed packages.
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(
                f"running {package} in a fresh Python failed (exit status {proc.returncode}):\n"
                f"{proc.stdout}\n{proc.stderr}"
            )
        return torch.load(dst, weights_only=True)


_TORCH_LOADS: dict[str, str | None] = {}


def torch_cannot_load_packages(device: str) -> str | None:
    """Whether this torch can load a ``.pt2`` in Python at all on ``device``:
    a model of torch's own ops (a linear layer, no custom op) is exported,
    compiled and loaded with ``torch._inductor.aoti_load_package`` in a fresh
    Python. Returns None if it runs and gives eager's outputs, else what went
    wrong (the control for :func:`run_in_fresh_python`'s tests: a failure
    here is torch's or the environment's, not an op's). Checked once per
    device and process.

    Seen: with torch 2.11.0+cu130 on an H100 machine, every ``.pt2``
    (CUDA, and CPU too on that machine) crashed the loading Python process
    (a segfault in the generated wrapper's ``std::regex``, parsing the
    device string while constructing the model container), this control's
    included; the C++ runner ran the same packages."""
    if device not in _TORCH_LOADS:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4).to(device).eval()
        x = torch.randn(3, 8, device=device)
        dims = ({0: torch.export.Dim("batch", min=1, max=1 << 16)},)
        with tempfile.TemporaryDirectory() as tmp:
            package = export_and_package(model, (x,), dims, Path(tmp) / "control.pt2")
            inputs = [torch.randn(5, 8, device=device)]
            try:
                (out,) = run_in_fresh_python(package, "", inputs, device)
                with torch.no_grad():
                    assert_same_outputs([out], [model(inputs[0])], device)
                _TORCH_LOADS[device] = None
            except (RuntimeError, AssertionError) as e:
                _TORCH_LOADS[device] = str(e)
    return _TORCH_LOADS[device]


def library_path(module: str) -> str:
    """The op package's compiled library, as ``python -m <module>
    --library-path`` prints it (the documented way to find it)."""
    proc = subprocess.run([sys.executable, "-m", module, "--library-path"], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m {module} --library-path failed:\n{proc.stderr}")
    path = proc.stdout.strip()
    if not Path(path).is_file():
        raise RuntimeError(f"python -m {module} --library-path printed {path!r}, not a file")
    return path


def torch_lib_dir() -> Path:
    """torch's shared libraries (libtorch, libc10, ...): what a deployed
    program needs at run time, through its rpath or ``LD_LIBRARY_PATH``."""
    return Path(torch.__file__).resolve().parent / "lib"


def compile_command(output: str | os.PathLike, source: str | os.PathLike = RUNNER_SOURCE) -> list[str]:
    """One compiler line that builds the runner against this torch wheel's
    libtorch (what CMakeLists.txt does, without CMake)."""
    from torch.utils.cpp_extension import include_paths

    lib = torch_lib_dir()
    cxx = os.environ.get("CXX", "g++")
    abi = int(torch.compiled_with_cxx11_abi())
    libs = ["-ltorch", "-ltorch_cpu", "-lc10"]
    if (lib / "libtorch_cuda.so").exists():
        # The CUDA model runner is registered by libtorch_cuda's initializers:
        # linked without --as-needed, so it is loaded although no symbol of it is used.
        libs += ["-ltorch_cuda", "-lc10_cuda"]
    return [
        cxx,
        "-std=c++20",
        "-O1",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        os.fspath(source),
        "-o",
        os.fspath(output),
        f"-L{lib}",
        "-Wl,--no-as-needed",
        *libs,
        "-Wl,--as-needed",
        f"-Wl,-rpath,{lib}",
        "-ldl",
    ]


def _cache_root() -> Path:
    env = os.environ.get("OPSCOMMON_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "opscommon"


def build_runner(cache_dir: str | os.PathLike | None = None) -> Path:
    """The C++ runner built against this torch, compiled once per torch
    build and runner source (cached under ``cache_dir``, default
    ``$OPSCOMMON_CACHE_DIR`` or ``~/.cache/opscommon``): every op package's
    tests share one build."""
    key_text = "\n".join(
        [torch.__version__, str(torch_lib_dir()), RUNNER_SOURCE.read_text(), shlex.join(compile_command("x"))]
    )
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    folder = Path(cache_dir) if cache_dir is not None else _cache_root() / "aoti-runner"
    exe = folder / f"aoti_runner-{torch.__version__.replace('+', '_')}-{key}"
    if exe.is_file():
        return exe
    folder.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_name(f"{exe.name}.{os.getpid()}.tmp")
    cmd = compile_command(tmp)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the AOTInductor runner failed:\n{shlex.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, exe)  # atomic: a concurrent build of the same key is harmless
    return exe


def run_in_cpp(
    runner: str | os.PathLike,
    package: str | os.PathLike,
    libraries: Sequence[str],
    inputs: Sequence[torch.Tensor],
    device: str = "cpu",
    workdir: str | os.PathLike | None = None,
    extra_env: dict[str, str] | None = None,
) -> tuple[list[torch.Tensor], str]:
    """Run the ``.pt2`` ``package`` with the C++ ``runner``, which loads the
    op ``libraries`` first; returns the outputs (on the CPU) and what the
    runner printed. Raises if the runner fails, including when libpython is
    mapped into its process. ``extra_env`` is added to its environment."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        src, dst = Path(tmp) / "inputs.pt", Path(tmp) / "outputs.pt"
        _save_inputs(inputs, src)
        cmd = [os.fspath(runner)]
        for lib in libraries:
            cmd += ["--library", lib]
        cmd += ["--package", os.fspath(package), "--inputs", str(src), "--outputs", str(dst), "--device", device]
        # The environment of a deployment: nothing of Python's.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env.update(extra_env or {})
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=env, timeout=600)
        if proc.returncode != 0:
            why = "libpython is mapped into the runner" if proc.returncode == 3 else "the runner failed"
            raise RuntimeError(f"{why} (exit {proc.returncode}): {shlex.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
        # torch::pickle_save writes a typed tensor list, rebuilt by this function.
        with torch.serialization.safe_globals([torch.jit._pickle.build_tensorlist]):
            return torch.load(dst, weights_only=True), proc.stdout


def cxx_available() -> bool:
    """Whether a C++ compiler for :func:`build_runner` is on PATH."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def libpython_path() -> str | None:
    """This interpreter's shared libpython, if it has one (to prove that the
    runner's libpython check fires: ``LD_PRELOAD`` it into the runner)."""
    import sysconfig

    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    path = Path(sysconfig.get_config_var("LIBDIR") or "") / (sysconfig.get_config_var("LDLIBRARY") or "")
    return str(path) if path.is_file() else None


def assert_same_outputs(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor], device: str) -> None:
    """Deployed outputs equal the eager ones: float32 tolerance on the CPU;
    on CUDA, AOTInductor's own GEMM and fused kernels may order sums
    differently from eager, so a looser relative tolerance."""
    assert len(outs) == len(refs), (len(outs), len(refs))
    tol = {} if device == "cpu" else {"rtol": 1e-4, "atol": 1e-5}
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref.detach().cpu(), **tol)
