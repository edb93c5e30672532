"""Python registration of vecadd_op::add: fake kernels, autograd, API."""

from __future__ import annotations

import os

import torch
import torch.autograd.forward_ad as _fwad
from torch import Tensor, nn

from . import _runtime

OP = "vecadd_op.add"

#: Supported dtypes, in the order the error messages list them.
DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
)

_runtime.load_library(os.path.dirname(os.path.abspath(__file__)))
_runtime.register_missing_cuda("vecadd_op", ["add", "add.out"])

_add = torch.ops.vecadd_op.add.default
_add_out = torch.ops.vecadd_op.add.out
# The kernel below the Python autograd kernel, without OpOverload.__call__.
_add_below_autograd = _runtime.below_autograd_caller(_add, arity=2)
# The out= entry without OpOverload.__call__ (public fallback: the op).
_add_out_raw = _runtime.op_callable(_add_out)
_below_ad_inplace_or_view = _runtime.below_ad_inplace_or_view
_increment_version = torch.autograd.graph.increment_version
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
# vmap / grad / jvp of torch.func: their wrapped tensors do not report
# requires_grad, so the op must go through the dispatcher's Autograd key.
_functorch_active = _runtime.functorch_active


# -- argument checks of the fake kernels: the same checks, in the same order
# and with the same messages, as csrc/vecadd.h, so torch.compile raises the
# error eager mode raises.
def _check_inputs(a: Tensor, b: Tensor) -> None:
    _runtime.check_dtype(OP, "a", a, DTYPES)
    _runtime.check_same_dtype(OP, "a", a, "b", b)
    _runtime.check_same_device(OP, "a", a, "b", b)
    _runtime.check_same_shape(OP, "a", a, "b", b)


def _device_str(t: Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index}"


def _shape_str(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_out(a: Tensor, out: Tensor) -> None:
    if out.dtype != a.dtype:
        raise RuntimeError(
            f"{OP}: argument 'out' must have the dtype of 'a' and 'b' "
            f"({_runtime.dtype_name(a.dtype)}), got {_runtime.dtype_name(out.dtype)}"
        )
    if out.device != a.device:
        raise RuntimeError(
            f"{OP}: argument 'out' must be on the device of 'a' and 'b' ({_device_str(a)}), got {_device_str(out)}"
        )
    if out.shape != a.shape:
        raise RuntimeError(
            f"{OP}: argument 'out' must have the shape of 'a' and 'b' ({_shape_str(a)}), "
            f"got {_shape_str(out)} (out= is never resized)"
        )
    for d, (size, stride) in enumerate(zip(out.shape, out.stride())):
        if size > 1 and stride == 0:
            raise RuntimeError(
                f"{OP}: argument 'out' has elements that share memory (dimension {d} has "
                f"stride 0, e.g. an expanded tensor); pass a tensor whose elements do not overlap"
            )


@torch.library.register_fake("vecadd_op::add")
def _add_fake(a: Tensor, b: Tensor) -> Tensor:
    _check_inputs(a, b)
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.register_fake("vecadd_op::add.out")
def _add_out_fake(a: Tensor, b: Tensor, *, out: Tensor) -> Tensor:
    _check_inputs(a, b)
    _check_out(a, out)
    return out


# -- autograd -----------------------------------------------------------------
# d(a + b)/da = d(a + b)/db = 1: the gradient goes to both inputs unchanged,
# the output's tangent is the sum of the inputs' tangents. No kernel either
# way, and the backward (the identity) is differentiable as it is.


class _AddFunction(torch.autograd.Function):
    """The autograd of vecadd_op::add: reverse and forward mode, at any
    torch.func level (vmap levels use the vmap rule below)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        return _add_below_autograd(a, b)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        need_a, need_b = ctx.needs_input_grad
        return (grad if need_a else None), (grad if need_b else None)

    @staticmethod
    def jvp(ctx, tangent_a: Tensor | None, tangent_b: Tensor | None) -> Tensor:
        if tangent_a is None:
            return tangent_b
        if tangent_b is None:
            return tangent_a
        return tangent_a + tangent_b


_runtime.register_autograd("vecadd_op::add", _AddFunction)
_apply = _runtime.function_apply(_AddFunction)

# The out= overload is not differentiable (like torch.add(..., out=)): its
# Autograd kernel rejects arguments that require grad, with grad mode on,
# before anything is written, and otherwise runs the kernel below autograd.
_lib = torch.library.Library("vecadd_op", "IMPL")


def _check_out_not_differentiated(a: Tensor, b: Tensor, out: Tensor) -> None:
    if torch.is_grad_enabled():
        for name, t in (("out", out), ("a", a), ("b", b)):
            if t.requires_grad:
                raise RuntimeError(
                    f"{OP}: argument '{name}' requires grad, but out= does not support "
                    f"automatic differentiation; call add(a, b) without out=, or call it "
                    f"under torch.no_grad()"
                )
    if _fwad._current_level >= 0:
        # Dual tensors (forward_ad, torch.func.jvp): as torch.add(..., out=),
        # refuse rather than drop the tangent.
        for name, t in (("out", out), ("a", a), ("b", b)):
            if _fwad.unpack_dual(t).tangent is not None:
                raise RuntimeError(
                    f"{OP}: argument '{name}' has a forward-mode AD tangent, but out= does not "
                    f"support forward-mode automatic differentiation; call add(a, b) without out="
                )


def _check_out_not_inference(out: Tensor) -> None:
    # What aten's in-place and out= ops raise (from the version counter bump,
    # which an inference tensor lacks and increment_version skips).
    if out.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{OP}: argument 'out' is an inference tensor: Inplace update to inference tensor "
            f"outside InferenceMode is not allowed. You can make a clone to get a normal tensor "
            f"before doing inplace update. See https://github.com/pytorch/rfcs/pull/17 for more "
            f"details."
        )


def _add_out_autograd(keyset, a: Tensor, b: Tensor, *, out: Tensor) -> Tensor:
    _check_out_not_differentiated(a, b, out)
    with _runtime.below_autograd():
        return _add_out.redispatch(keyset & _runtime.after_autograd_keyset, a, b, out=out)


_lib.impl("add.out", _add_out_autograd, "Autograd", with_keyset=True)


# out is written in place: bump its version counter, as aten's out= ops do,
# so that autograd notices when a tensor saved for backward was overwritten.
# (A schema defined through the stable ABI gets no ADInplaceOrView kernel.)
def _add_out_ad_inplace_or_view(keyset, a: Tensor, b: Tensor, *, out: Tensor) -> Tensor:
    _check_out_not_inference(out)
    _increment_version(out)
    return _add_out.redispatch(keyset & _runtime.after_ad_inplace_or_view_keyset, a, b, out=out)


_lib.impl("add.out", _add_out_ad_inplace_or_view, "ADInplaceOrView", with_keyset=True)


# -- vmap -------------------------------------------------------------------
def _add_vmap(info, in_dims, a: Tensor, b: Tensor):
    def batched_first(t: Tensor, dim: int | None) -> Tensor:
        if dim is None:
            return t.unsqueeze(0).expand(info.batch_size, *t.shape)
        return t.movedim(dim, 0)

    return _add(batched_first(a, in_dims[0]), batched_first(b, in_dims[1])), 0


torch.library.register_vmap("vecadd_op::add", _add_vmap)


# -- public API ---------------------------------------------------------------
def add(a: Tensor, b: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Elementwise ``a + b``.

    Args:
        a, b: tensors of the same shape, dtype (float16, bfloat16, float32,
            float64, int32 or int64) and device (CPU or CUDA), any strides.
        out: optional tensor of that same shape, dtype and device to write
            the result into (any strides; it may be ``a`` or ``b``, or
            overlap them). It is never resized, and is left unchanged when
            the call is rejected. out= does not support autograd: with grad
            mode on, none of ``a``, ``b`` and ``out`` may require grad.

    Returns:
        A new contiguous tensor holding ``a + b``, or ``out`` when given.
        Without ``out``, the gradient flows to both ``a`` and ``b``.
        Integer sums wrap around on overflow, as in ``torch.add``.

    Raises:
        TypeError: ``a``, ``b`` or ``out`` is not a tensor.
        RuntimeError: mismatched shapes, dtypes or devices, an unsupported
            dtype or a bad ``out``; the message names the argument.
    """
    if out is None:
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            _check_are_tensors(a, b, out)
        if _is_compiling() or _functorch_active():
            # torch.compile traces the registered op; torch.func transforms
            # run its autograd and vmap rule level by level.
            return _add(a, b)
        if ((a.requires_grad or b.requires_grad) and _grad_enabled()) or _fwad._current_level >= 0:
            # Autograd, or forward AD (a dual_level is open: a or b may be
            # dual tensors).
            return _apply(a, b)
        # Nothing for autograd to record: skip the Python autograd kernel,
        # which would only redispatch below autograd itself, at a cost of
        # several microseconds per call (more than a small add takes).
        return _add_below_autograd(a, b)
    if not (isinstance(a, Tensor) and isinstance(b, Tensor) and isinstance(out, Tensor)):
        _check_are_tensors(a, b, out)
    if _is_compiling():
        return _add_out_traced(a, b, out)
    if (
        _functorch_active()
        or _fwad._current_level >= 0
        or (_grad_enabled() and (a.requires_grad or b.requires_grad or out.requires_grad))
    ):
        # The Autograd kernel rejects out= with arguments that require grad
        # or carry a forward-AD tangent.
        return _add_out(a, b, out=out)
    # Below the Python Autograd and ADInplaceOrView kernels, doing the
    # latter's jobs (the inference-tensor check, the version bump) here.
    if out.is_inference():
        _check_out_not_inference(out)
    with _below_ad_inplace_or_view():
        result = _add_out_raw(a, b, out=out)
    _increment_version(out)
    return result


def _out_is_valid(a: Tensor, out: Tensor) -> bool:
    """What check_out accepts, as a bool that torch.compile can trace."""
    if out.dtype != a.dtype or out.device != a.device or out.shape != a.shape:
        return False
    return not any(size > 1 and stride == 0 for size, stride in zip(out.shape, out.stride()))


def _add_out_traced(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """out= under torch.compile / export.

    PyTorch cannot functionalize a custom op whose return aliases an input
    (``-> Tensor(a!)``) unless its schema carries ``torch.Tag.out``, which
    the stable ABI can set only from torch 2.12 on. So a traced out= adds
    into a new tensor and copies that into ``out``: the same values as eager
    mode, overlapping ``out`` included. A call eager mode rejects goes to
    the out= op itself, whose Autograd or fake kernel raises the eager error
    while the graph is traced.
    """
    if (_grad_enabled() and (a.requires_grad or b.requires_grad or out.requires_grad)) or not (_out_is_valid(a, out)):
        return _add_out(a, b, out=out)
    return out.copy_(_add(a, b))


def _check_are_tensors(a: object, b: object, out: object) -> None:
    _runtime.check_tensor(OP, "a", a)
    _runtime.check_tensor(OP, "b", b)
    if out is not None:
        _runtime.check_tensor(OP, "out", out)


class VecAdd(nn.Module):
    """``nn.Module`` wrapper of :func:`add`: ``VecAdd()(a, b) == add(a, b)``."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return add(a, b)
