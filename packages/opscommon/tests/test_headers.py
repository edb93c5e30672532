"""Compile a tiny extension against opscommon's headers with the build
helper's flags, load it, and check what the headers do."""

from __future__ import annotations

import os
from pathlib import Path

import opscommon
import pytest
import torch
from opscommon.build import compile_flags
from torch.utils.cpp_extension import load

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    build_dir = tmp_path_factory.mktemp("tiny_build")
    load(
        name="opscommon_tiny",
        sources=[str(HERE / "ext" / "csrc" / "tiny_ops.cpp")],
        extra_cflags=compile_flags(cuda=False)["cxx"],
        extra_include_paths=[opscommon.get_include()],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=bool(os.environ.get("VERBOSE")),
    )
    return torch.ops.opscommon_tiny


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]
)
@pytest.mark.parametrize("n", [0, 1, 31, 100_003])  # 100_003 crosses the parallel grain
def test_cpu_map_and_dispatch(tiny, dtype, n):
    x = (torch.randn(n) * 100).to(dtype)
    y = (torch.randn(n) * 100).to(dtype)
    want = (2 * x.double() + y.double()).to(dtype)
    torch.testing.assert_close(tiny.axpy(x, y), want)


def test_non_contiguous_inputs(tiny):
    x = torch.randn(8, 6).t()
    y = torch.randn(16, 6)[::2].t()
    torch.testing.assert_close(tiny.axpy(x, y), 2 * x + y)


@pytest.mark.parametrize(
    "x, y, message",
    [
        (
            torch.ones(3),
            torch.ones(4),
            r"opscommon_tiny.axpy: arguments 'x' and 'y' must have the same shape, got \[3\] and \[4\]",
        ),
        (
            torch.ones(3),
            torch.ones(3, dtype=torch.float64),
            "arguments 'x' and 'y' must have the same dtype, got float32 and float64",
        ),
        (
            torch.ones(3, dtype=torch.bool),
            torch.ones(3, dtype=torch.bool),
            "argument 'x' has dtype bool; supported dtypes are float32, float64",
        ),
    ],
)
def test_checks_name_op_and_argument(tiny, x, y, message):
    with pytest.raises(RuntimeError, match=message):
        tiny.axpy(x, y)


def test_check_shape_wildcards(tiny):
    tiny.rows_of_three(torch.ones(5, 3))
    with pytest.raises(RuntimeError, match=r"argument 'x' must have shape \[\*, 3\], got \[5, 4\]"):
        tiny.rows_of_three(torch.ones(5, 4))


def test_kernel_exceptions_become_runtime_errors(tiny):
    with pytest.raises(RuntimeError, match=r"opscommon_tiny.raise_plain: plain \[message\]"):
        tiny.raise_plain(torch.ones(2))
    # Numbers in messages (sizes) once crashed some torch builds: see checks.h.
    with pytest.raises(RuntimeError, match=r"opscommon_tiny.raise_with_size: size 7 shape \[7, 2\]"):
        tiny.raise_with_size(torch.ones(7, 2))


@pytest.mark.parametrize("rows, a, b", [(3, 4, 5), (1, 4, 5), (3, 1, 5), (3, 4, 1), (0, 4, 5), (3, 0, 5), (1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int64])
def test_empty_contiguous_has_torch_strides(tiny, rows, a, b, dtype):
    out = tiny.empty_rows(torch.ones(rows, dtype=dtype), a, b)
    want = torch.empty(rows, a, b, dtype=dtype)
    assert (out.shape, out.stride(), out.dtype, out.device) == (want.shape, want.stride(), want.dtype, want.device)
    assert out.is_contiguous()


@pytest.mark.parametrize(
    "a, b, size",
    [
        (2**40, 2**10, r"\[4, 1099511627776, 1024\] \(18014398509481984 bytes\)"),
        (2**61, 4, r"\[4, 2305843009213693952, 4\] \(more than 2\^63 bytes\)"),
    ],
)
def test_empty_contiguous_failure_names_op_buffer_and_size(tiny, a, b, size):
    """Too large to allocate (first) or to count in int64 (second)."""
    message = (
        rf"^opscommon_tiny.empty_rows: could not allocate the rows, a float32 tensor of shape {size} "
        r"on cpu \(out of memory\?\)$"
    )
    with pytest.raises(RuntimeError, match=message):
        tiny.empty_rows(torch.ones(4), a, b)
