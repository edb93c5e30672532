"""Python registration of round_op::round_ste: fake kernel, autograd, API."""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from . import _runtime

OP = "round_op.round_ste"

_runtime.load_library(os.path.dirname(os.path.abspath(__file__)))
_runtime.register_missing_cuda("round_op", ["round_ste"])


@torch.library.register_fake("round_op::round_ste")
def _round_ste_fake(x: Tensor) -> Tensor:
    _runtime.check_dtype(OP, "x", x, _runtime.FLOATING_DTYPES)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _round_ste_backward(ctx, grad: Tensor) -> Tensor:
    # Straight-through: no kernel, the gradient passes through unchanged.
    return grad


torch.library.register_autograd("round_op::round_ste", _round_ste_backward)


def round_ste(x: Tensor) -> Tensor:
    """Round half up in the forward pass, identity gradient in the backward.

    Args:
        x: a float16, bfloat16, float32 or float64 tensor of any shape, on
            the CPU or a CUDA device.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype holding
        ``floor(x + 0.5)`` (so 0.5 -> 1 and 2.5 -> 3, unlike ``torch.round``,
        which rounds half to even).
    """
    _runtime.check_tensor(OP, "x", x)
    return torch.ops.round_op.round_ste.default(x)


class RoundSTE(nn.Module):
    """``nn.Module`` wrapper of :func:`round_ste`."""

    def forward(self, x: Tensor) -> Tensor:
        return round_ste(x)
