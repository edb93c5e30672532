"""Run-time support of a built op package: load its binary, check the torch it
runs in, and the argument checks its fake kernels share with the C++ ones.

This file is copied from opscommon into every op package at build time (as
``<package>/_runtime.py``, with ``BUILD_INFO`` filled in), so an installed op
package needs nothing from opscommon at run time.
"""

from __future__ import annotations

import glob
import os
from typing import Iterable, Sequence

import torch

BUILD_INFO: dict = {}  # filled in at build time

FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
}


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch(info: dict = BUILD_INFO) -> None:
    """Raise ImportError when the running torch cannot load this binary."""
    pkg = info["package"]
    found = torch.__version__
    if _version_tuple(found) < _version_tuple(info["torch_min"]):
        raise ImportError(
            f"{pkg} {info['version']} is built on the LibTorch stable ABI for torch >= "
            f"{info['torch_min']} (built with torch {info['torch_built_with']}), but torch "
            f"{found} is installed. Install torch>={info['torch_min']}."
        )
    built_cuda = info.get("cuda")
    if built_cuda is not None:
        running = torch.version.cuda
        if running is None:
            raise ImportError(
                f"{pkg} {info['version']} is a CUDA {built_cuda} build, but torch {found} is a "
                f"CPU-only build. Install a CUDA {built_cuda.split('.')[0]}.x build of torch, or "
                f"the CPU build of {pkg}."
            )
        if running.split(".")[0] != built_cuda.split(".")[0]:
            raise ImportError(
                f"{pkg} {info['version']} is a CUDA {built_cuda} build, but torch {found} uses "
                f"CUDA {running}. Install a torch built for CUDA {built_cuda.split('.')[0]}.x, or "
                f"rebuild {pkg} from source against this torch."
            )


def load_library(package_dir: str, info: dict = BUILD_INFO) -> str:
    """Check the torch version, then load ``_C*.so`` into torch's dispatcher."""
    check_torch(info)
    candidates = sorted(glob.glob(os.path.join(package_dir, "_C*.so")))
    if not candidates:
        raise ImportError(f"{info['package']}: compiled library _C*.so not found in {package_dir}")
    torch.ops.load_library(candidates[0])
    return candidates[0]


def register_missing_cuda(namespace: str, op_names: Iterable[str], info: dict = BUILD_INFO) -> None:
    """In a CPU-only build, give CUDA tensors a clear error instead of the
    dispatcher's bare NotImplementedError."""
    if info.get("cuda") is not None:
        return
    lib = torch.library.Library(namespace, "IMPL")
    for name in op_names:

        def _no_cuda(*args, _name=name, **kwargs):
            raise RuntimeError(
                f"{namespace}.{_name}: this {info['package']} {info['version']} is a CPU-only "
                f"build and got a CUDA tensor. Install the CUDA build, or rebuild from source "
                f"with nvcc present (OPS_CUDA=1)."
            )

        lib.impl(name, _no_cuda, "CUDA")
    # Keep the registration alive as long as the module.
    _KEEP_ALIVE.append(lib)


_KEEP_ALIVE: list = []


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _fail(message: str) -> None:
    raise RuntimeError(message)


def check_tensor(op: str, arg: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{arg}' must be a tensor, got {type(t).__name__}")


def check_dtype(op: str, arg: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        if tuple(allowed) == FLOATING_DTYPES:
            _fail(
                f"{op}: argument '{arg}' must be a floating-point tensor (float16, bfloat16, "
                f"float32 or float64), got {dtype_name(t.dtype)}"
            )
        names = ", ".join(dtype_name(d) for d in allowed)
        _fail(f"{op}: argument '{arg}' has dtype {dtype_name(t.dtype)}; supported dtypes are {names}")


def check_same_dtype(op: str, arg_a: str, a: torch.Tensor, arg_b: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        _fail(
            f"{op}: arguments '{arg_a}' and '{arg_b}' must have the same dtype, got "
            f"{dtype_name(a.dtype)} and {dtype_name(b.dtype)}"
        )


def _device_str(t: torch.Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index}"


def check_same_device(op: str, arg_a: str, a: torch.Tensor, arg_b: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        _fail(
            f"{op}: arguments '{arg_a}' and '{arg_b}' must be on the same device, got "
            f"{_device_str(a)} and {_device_str(b)}"
        )


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_same_shape(op: str, arg_a: str, a: torch.Tensor, arg_b: str, b: torch.Tensor) -> None:
    if tuple(a.shape) != tuple(b.shape):
        _fail(
            f"{op}: arguments '{arg_a}' and '{arg_b}' must have the same shape, got "
            f"{_shape_str(a.shape)} and {_shape_str(b.shape)}"
        )


def check_shape(op: str, arg: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    """``expected`` entries < 0 match any size."""
    ok = t.dim() == len(expected) and all(e < 0 or s == e for s, e in zip(t.shape, expected))
    if not ok:
        want = "[" + ", ".join("*" if e < 0 else str(e) for e in expected) + "]"
        _fail(f"{op}: argument '{arg}' must have shape {want}, got {_shape_str(t.shape)}")
