"""Python registration of round_op::round_ste: fake kernel, autograd, API."""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from . import _runtime

OP = "round_op.round_ste"

_runtime.load_library(os.path.dirname(os.path.abspath(__file__)))
_runtime.register_missing_cuda("round_op", ["round_ste"])


_round_ste = torch.ops.round_op.round_ste.default
# The kernel below the Python autograd kernel, without OpOverload.__call__.
_round_ste_below_autograd = _runtime.below_autograd_caller(_round_ste, arity=1)
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_functorch_active = _runtime.functorch_active
_fwad = _runtime._forward_ad


@torch.library.register_fake("round_op::round_ste")
def _round_ste_fake(x: Tensor) -> Tensor:
    _runtime.check_dtype(OP, "x", x, _runtime.FLOATING_DTYPES)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# -- autograd: straight through, both ways ---------------------------------------
# backward: the gradient passes through unchanged (no kernel); jvp: so does
# the tangent. The second derivative is zero (the backward is the identity,
# which autograd differentiates by itself when create_graph=True).


def _backward(ctx, grad: Tensor) -> Tensor:
    return grad


def _jvp(ctx, tangent: Tensor) -> Tensor:
    return tangent


class _RoundSTEFunction(torch.autograd.Function):
    """The autograd of round_ste: reverse and forward mode, at any torch.func
    level (vmap levels use the vmap rule below)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return _round_ste_below_autograd(x)

    backward = staticmethod(_backward)
    jvp = staticmethod(_jvp)


_runtime.register_autograd("round_op::round_ste", _RoundSTEFunction)
_apply = _runtime.function_apply(_RoundSTEFunction)


def _round_ste_vmap(info, in_dims, x: Tensor):
    # Elementwise: the batch dimension stays where it is.
    return _round_ste(x), in_dims[0]


torch.library.register_vmap("round_op::round_ste", _round_ste_vmap)


def round_ste(x: Tensor) -> Tensor:
    """Round half up in the forward pass, identity gradient in the backward.

    Args:
        x: a float16, bfloat16, float32 or float64 tensor of any shape, on
            the CPU or a CUDA device.

    Returns:
        A new contiguous tensor of ``x``'s shape and dtype holding
        ``floor(x + 0.5)`` (so 0.5 -> 1 and 2.5 -> 3, unlike ``torch.round``,
        which rounds half to even; -0.0 and -0.25 -> +0.0). Reverse mode
        (``backward``, ``torch.func.grad``/``vjp``/``jacrev``) passes the
        gradient through unchanged, forward mode (``torch.func.jvp``,
        ``jacfwd``, dual tensors) the tangent; ``torch.func.vmap`` works.
    """
    if not isinstance(x, Tensor):
        _runtime.check_tensor(OP, "x", x)
    if _is_compiling() or _functorch_active():
        # The registered op: torch.compile traces it, torch.func transforms
        # run its autograd and vmap rule level by level.
        return _round_ste(x)
    if (x.requires_grad and _grad_enabled()) or _fwad._current_level >= 0:
        # Autograd, or forward AD (a dual_level is open: x may be dual).
        return _apply(x)
    # Nothing to differentiate: the kernel below autograd, without the
    # Python autograd kernel's redispatch.
    return _round_ste_below_autograd(x)


class RoundSTE(nn.Module):
    """``nn.Module`` wrapper of :func:`round_ste`."""

    def forward(self, x: Tensor) -> Tensor:
        return round_ste(x)
