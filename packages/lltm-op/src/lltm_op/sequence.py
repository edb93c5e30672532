"""The LLTM over whole sequences: ``lltm_sequence`` and the ``LLTMSequence``
module, on the fused multi-step ops ``lltm_op::sequence_forward`` and
``lltm_op::sequence_backward``.

What runs (T steps, B batch rows, F input features, S state size):

    forward:   P = X W_x^T                        all T steps, one matrix product
               per step: G_t = P_t + h_{t-1} W_h^T + b; h_t, c_t = cell(G_t, c_{t-1})
    backward:  per step, in reverse: dh_t = grad_outputs[t] + dG_{t+1} W_h
                                     dG_t, dc_{t-1} = cell_backward(...)
               weight and input gradients: large products over many steps at once

The time loop runs in C++ (the matrix products through torch's dispatcher;
on CUDA, for small batch and state sizes, the recurrent product is fused into
the step kernel), with no Python per step, and the whole sequence is one
autograd node.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import _runtime
from . import ops as _ops  # loads the compiled library

OP = "lltm_op.lltm_sequence"
OP_FORWARD = "lltm_op.sequence_forward"
OP_BACKWARD = "lltm_op.sequence_backward"

_runtime.register_missing_cuda("lltm_op", ["sequence_forward", "sequence_backward"])

_seq_forward = torch.ops.lltm_op.sequence_forward.default
_seq_backward = torch.ops.lltm_op.sequence_backward.default

_FLOATING = _runtime.FLOATING_DTYPES
_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)
_INT64_MAX = 2**63 - 1
_NAMES = ("input", "weights", "bias", "old_h", "old_cell")


# -- argument checks (the fake kernels raise what the C++ kernels raise) ----------


def _check_fits(op: str, T, B, F, S) -> None:
    # Same as check_sizes_fit in csrc/lltm_sequence.h; only concrete sizes.
    if not all(isinstance(v, int) for v in (T, B, F, S)):
        return
    checks = [
        (3 * S, "the state size", "is too large (its element count overflows int64)"),
        (S + F, "state size + input features", "is too large (overflows int64)"),
        (T * B, "the sequence (T * B)", "is too large (its element count overflows int64)"),
        (T * B * 3 * S, "the sequence (T * B * 3S)", "is too large (its element count overflows int64)"),
        (T * B * max(F, 1), "the input (T * B * F)", "is too large (its element count overflows int64)"),
        (3 * S * (S + F), "the weights (3S * (S + F))", "is too large (its element count overflows int64)"),
    ]
    for value, what, tail in checks:
        if value > _INT64_MAX:
            raise RuntimeError(f"{op}: {what} {tail}")


def _check_forward(op: str, input, weights, bias, old_h, old_cell) -> tuple[int, int, int, int]:
    args = dict(zip(_NAMES, (input, weights, bias, old_h, old_cell)))
    for name, t in args.items():
        _runtime.check_dtype(op, name, t, _FLOATING)
    _runtime.check_shape(op, "input", input, (-1, -1, -1))
    T, B, F = input.shape
    _runtime.check_shape(op, "old_h", old_h, (B, -1))
    S = old_h.shape[1]
    _check_fits(op, T, B, F, S)
    _runtime.check_shape(op, "old_cell", old_cell, (B, S))
    _runtime.check_shape(op, "weights", weights, (3 * S, S + F))
    _runtime.check_shape(op, "bias", bias, (3 * S,))
    for name, t in args.items():
        if name != "input":
            _runtime.check_same_dtype(op, "input", input, name, t)
    for name, t in args.items():
        if name != "input":
            _ops._check_same_device(op, "input", input, name, t)
    return T, B, F, S


def _check_like(op: str, arg: str, t: Tensor, input: Tensor, shape) -> None:
    _runtime.check_dtype(op, arg, t, _FLOATING)
    _runtime.check_shape(op, arg, t, shape)
    _runtime.check_same_dtype(op, "input", input, arg, t)
    _ops._check_same_device(op, "input", input, arg, t)


# -- fake kernels ---------------------------------------------------------------------


@torch.library.register_fake("lltm_op::sequence_forward")
def _sequence_forward_fake(input, weights, bias, old_h, old_cell):
    T, B, F, S = _check_forward(OP_FORWARD, input, weights, bias, old_h, old_cell)
    return (
        input.new_empty((T, B, S)),
        input.new_empty((B, S)),
        input.new_empty((B, S)),
        input.new_empty((T, B, 3 * S)),
        input.new_empty((T, B, S)),
    )


@torch.library.register_fake("lltm_op::sequence_backward")
def _sequence_backward_fake(
    grad_outputs, grad_h_n, grad_c_n, input, weights, old_h, old_cell, outputs, gates, cells, input_grad
):
    op = OP_BACKWARD
    _runtime.check_dtype(op, "input", input, _FLOATING)
    _runtime.check_shape(op, "input", input, (-1, -1, -1))
    T, B, F = input.shape
    _runtime.check_dtype(op, "old_h", old_h, _FLOATING)
    _runtime.check_shape(op, "old_h", old_h, (B, -1))
    S = old_h.shape[1]
    _check_fits(op, T, B, F, S)
    _runtime.check_same_dtype(op, "input", input, "old_h", old_h)
    _ops._check_same_device(op, "input", input, "old_h", old_h)
    _check_like(op, "weights", weights, input, (3 * S, S + F))
    _check_like(op, "old_cell", old_cell, input, (B, S))
    _check_like(op, "outputs", outputs, input, (T, B, S))
    _check_like(op, "gates", gates, input, (T, B, 3 * S))
    _check_like(op, "cells", cells, input, (T, B, S))
    for name, g, shape in (
        ("grad_outputs", grad_outputs, (T, B, S)),
        ("grad_h_n", grad_h_n, (B, S)),
        ("grad_c_n", grad_c_n, (B, S)),
    ):
        if g is not None:
            _check_like(op, name, g, input, shape)
    return (
        input.new_empty((T, B, F) if input_grad else (0,)),
        input.new_empty((3 * S, S + F)),
        input.new_empty((3 * S,)),
        input.new_empty((B, S)),
        input.new_empty((B, S)),
    )


# -- autograd: one node for the whole sequence -------------------------------------------

_below_autograd = _runtime.below_autograd


def _setup_context(ctx, inputs, output) -> None:
    input, weights, _bias, old_h, old_cell = inputs
    outputs, _h_n, _c_n, gates, cells = output
    # The pre-activations and cell states of every step (the op's last two
    # outputs) plus the h of every step (its first) are all the backward
    # needs beyond the inputs; the bias is folded into the gates.
    ctx.save_for_backward(input, weights, old_h, old_cell, outputs, gates, cells)
    ctx.mark_non_differentiable(gates, cells)
    ctx.set_materialize_grads(False)


class _NoDoubleBackward(torch.autograd.Function):
    """Passes the first-order gradients through (copies) when autograd builds
    a graph of them (create_graph=True; torch.func's grad and vjp always do),
    connected to what they depend on, and refuses to be differentiated: a
    second derivative through lltm_sequence is an error, never a silent zero."""

    generate_vmap_rule = True

    @staticmethod
    def forward(count, *tensors):
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{OP}: double backward is not supported: the gradients of lltm_sequence are not "
            "differentiable (a second derivative, e.g. of a gradient penalty, through it)"
        )


def _backward(ctx, grad_outputs, grad_h_n, grad_c_n, _grad_gates=None, _grad_cells=None):
    needs = ctx.needs_input_grad
    if (grad_outputs is None and grad_h_n is None and grad_c_n is None) or not any(needs):
        return None, None, None, None, None
    input, weights, old_h, old_cell, outputs, gates, cells = ctx.saved_tensors
    # Below autograd: the op has no derivative of its own (its matrix
    # products must not see tensors that require grad; see _NoDoubleBackward).
    with _below_autograd():
        d_input, d_weights, d_bias, d_old_h, d_old_cell = _seq_backward(
            grad_outputs,
            grad_h_n,
            grad_c_n,
            input,
            weights,
            old_h,
            old_cell,
            outputs,
            gates,
            cells,
            bool(needs[0]),
        )
    grads = [
        d_input if needs[0] else None,
        d_weights if needs[1] else None,
        d_bias if needs[2] else None,
        d_old_h if needs[3] else None,
        d_old_cell if needs[4] else None,
    ]
    if torch.is_grad_enabled():
        present = [k for k, g in enumerate(grads) if g is not None]
        deps = [t for t in (input, weights, old_h, old_cell, grad_outputs, grad_h_n, grad_c_n) if t is not None]
        wrapped = _NoDoubleBackward.apply(len(present), *(grads[k] for k in present), *deps)
        for k, g in zip(present, wrapped):
            grads[k] = g
    return tuple(grads)


torch.library.register_autograd("lltm_op::sequence_forward", _backward, setup_context=_setup_context)


def _vmap_by_loop(op, n_out: int):
    """A batching rule that runs the op once per sample (the batched
    dimension is rarely large for a whole-sequence op; per-sample weight
    gradients, vmap(grad(...)), need one backward per sample anyway)."""

    def rule(info, in_dims, *args):
        size = info.batch_size
        if size == 0:
            raise RuntimeError(f"{OP}: vmap over an empty batch is not supported")
        results = []
        for n in range(size):
            sliced = [a.select(d, n) if d is not None else a for a, d in zip(args, in_dims)]
            results.append(op(*sliced))
        return tuple(torch.stack([r[k] for r in results]) for k in range(n_out)), (0,) * n_out

    return rule


torch.library.register_vmap("lltm_op::sequence_forward", _vmap_by_loop(_seq_forward, 5))
torch.library.register_vmap("lltm_op::sequence_backward", _vmap_by_loop(_seq_backward, 5))


class _SequenceFunction(torch.autograd.Function):
    """The eager path to the same forward, backward and saved tensors as the
    registered autograd (cheaper per call), and a clear refusal of
    forward-mode AD. torch.compile and torch.export trace the op itself."""

    generate_vmap_rule = True

    @staticmethod
    def forward(input, weights, bias, old_h, old_cell):
        with _below_autograd():
            return _seq_forward(input, weights, bias, old_h, old_cell)

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(
            f"{OP}: forward-mode AD (jvp, torch.autograd.forward_ad, torch.func.jvp) is not "
            "supported; use reverse mode (backward)"
        )


# Function.apply binds the arguments through inspect.signature on every call
# when setup_context is defined (about 100 us a call measured here, more than
# the rest of a small sequence's Python work): outside torch.func transforms,
# the runtime's apply, with nothing to bind.
_fast_apply = _runtime.function_apply(_SequenceFunction)


def _apply(*args):
    if _runtime.functorch_active():
        return _SequenceFunction.apply(*args)
    return _fast_apply(*args)


_forward_ad_active = _runtime.forward_ad_active


def _run(input, weights, bias, old_h, old_cell):
    if torch.compiler.is_compiling():
        return _seq_forward(input, weights, bias, old_h, old_cell)
    if _forward_ad_active() or (
        torch.is_grad_enabled()
        and (
            input.requires_grad
            or weights.requires_grad
            or bias.requires_grad
            or old_h.requires_grad
            or old_cell.requires_grad
        )
    ):
        return _apply(input, weights, bias, old_h, old_cell)
    with _below_autograd():
        return _seq_forward(input, weights, bias, old_h, old_cell)


# -- the public function ---------------------------------------------------------------------


def _explain_bad_args(input, weights, bias, old_h, old_cell) -> None:
    """Raise the error that names the first offending argument."""
    args = dict(zip(_NAMES, (input, weights, bias, old_h, old_cell)))
    for name, t in args.items():
        _runtime.check_tensor(OP, name, t)
    _runtime.check_dtype(OP, "input", input, _FLOATING)
    for name, t in args.items():
        if name != "input":
            _runtime.check_same_dtype(OP, "input", input, name, t)
    for name, t in args.items():
        if name != "input":
            _ops._check_same_device(OP, "input", input, name, t)
    _runtime.check_shape(OP, "input", input, (-1, -1, -1))
    T, B, F = input.shape
    _runtime.check_shape(OP, "old_h", old_h, (B, -1))
    S = old_h.shape[1]
    _check_fits(OP, T, B, F, S)
    _runtime.check_shape(OP, "old_cell", old_cell, (B, S))
    _runtime.check_shape(OP, "weights", weights, (3 * S, S + F))
    _runtime.check_shape(OP, "bias", bias, (3 * S,))


def _args_ok(input, weights, bias, old_h, old_cell) -> bool:
    # Cheap attribute reads only; any doubt goes to _explain_bad_args.
    if not (
        isinstance(input, Tensor)
        and isinstance(weights, Tensor)
        and isinstance(bias, Tensor)
        and isinstance(old_h, Tensor)
        and isinstance(old_cell, Tensor)
        and input.dim() == 3
        and old_h.dim() == 2
    ):
        return False
    dtype, device = input.dtype, input.device
    T, B, F = input.shape
    S = old_h.shape[1]
    return (
        dtype in _FLOATING
        and weights.dtype is dtype
        and bias.dtype is dtype
        and old_h.dtype is dtype
        and old_cell.dtype is dtype
        and weights.device == device
        and bias.device == device
        and old_h.device == device
        and old_cell.device == device
        and old_h.shape[0] == B
        and old_cell.shape == (B, S)
        and weights.shape == (3 * S, S + F)
        and bias.shape == (3 * S,)
    )


def lltm_sequence(
    input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor, old_cell: Tensor
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The LLTM cell run over a whole sequence, fused.

    Args:
        input: ``[T, B, F]``, the inputs of all T steps (T may be 0).
        weights: ``[3*S, S+F]``, the cell's own weights (``LLTM.weights``).
        bias: ``[3*S]``, the cell's own bias (``LLTM.bias``).
        old_h: ``[B, S]``, the initial hidden state.
        old_cell: ``[B, S]``, the initial cell state.

    All five on one device (CPU or CUDA) and of one dtype (float16,
    bfloat16, float32 or float64); any strides. Under autocast, float16,
    bfloat16 and float32 arguments run in the autocast dtype and the results
    come back in the dtype the pure-PyTorch cell would give.

    Returns:
        ``(outputs, (h_n, c_n))``: ``outputs`` ``[T, B, S]`` holds the new h of
        every step, ``h_n`` and ``c_n`` ``[B, S]`` the final state (the initial
        one when T is 0); the same as T calls of :func:`lltm_op.lltm`, with
        gradients to all five arguments through every output. One autograd
        node for the whole sequence; double backward and forward-mode AD are
        refused with an error.
    """
    if isinstance(input, Tensor) and torch.is_autocast_enabled(input.device.type):
        return _autocast_sequence(input, weights, bias, old_h, old_cell)
    if not _args_ok(input, weights, bias, old_h, old_cell):
        _explain_bad_args(input, weights, bias, old_h, old_cell)
    outputs, h_n, c_n, _, _ = _run(input, weights, bias, old_h, old_cell)
    return outputs, (h_n, c_n)


def _autocast_sequence(input, weights, bias, old_h, old_cell):
    device_type = input.device.type
    args = (input, weights, bias, old_h, old_cell)
    for name, t in zip(_NAMES, args):
        _runtime.check_tensor(OP, name, t)
    low = torch.get_autocast_dtype(device_type)
    # As torch's autocast does for a matrix product: float16, bfloat16 and
    # float32 arguments go to the autocast dtype, float64 ones stay.
    cast = [t.to(low) if t.dtype in _AUTOCAST_ELIGIBLE else t for t in args]
    with torch.autocast(device_type, enabled=False):
        if not _args_ok(*cast):
            _explain_bad_args(*cast)
        outputs, h_n, c_n, _, _ = _run(*cast)
    # The pure cell's results: its cell state keeps old_cell's dtype.
    out_dtype = torch.promote_types(old_cell.dtype, outputs.dtype)
    return outputs.to(out_dtype), (h_n.to(out_dtype), c_n.to(out_dtype))


class LLTMSequence(nn.Module):
    """The LLTM cell over whole sequences, as ``nn.LSTM`` is to ``nn.LSTMCell``.

    Same parameters as :class:`lltm_op.LLTM` (``weights`` ``[3*S, S+F]``,
    ``bias`` ``[3*S]``, same names and initialisation), so a trained cell's
    ``state_dict`` loads into it, or :meth:`from_cell` shares the cell's
    parameters.

    ``forward(input, state=None)``: ``input`` ``[T, B, F]``, ``state`` an
    optional ``(h_0, c_0)`` (zeros when omitted); returns
    ``(outputs, (h_n, c_n))``.
    """

    def __init__(self, input_features: int, state_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.input_features = input_features
        self.state_size = state_size
        factory = {"device": device, "dtype": dtype}
        self.weights = nn.Parameter(torch.empty(3 * state_size, input_features + state_size, **factory))
        self.bias = nn.Parameter(torch.empty(3 * state_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.state_size)
        for weight in self.parameters():
            nn.init.uniform_(weight, -stdv, +stdv)

    @classmethod
    def from_cell(cls, cell: nn.Module) -> LLTMSequence:
        """A sequence module that shares ``cell``'s parameters (no copy)."""
        seq = cls.__new__(cls)
        nn.Module.__init__(seq)
        seq.input_features = cell.input_features
        seq.state_size = cell.state_size
        seq.weights = cell.weights
        seq.bias = cell.bias
        return seq

    def forward(self, input: Tensor, state: tuple[Tensor, Tensor] | None = None):
        if state is None:
            batch = input.shape[1] if isinstance(input, Tensor) and input.dim() == 3 else 0
            zeros = torch.zeros(batch, self.state_size, dtype=input.dtype, device=input.device)
            state = (zeros, zeros)
        old_h, old_cell = state
        return lltm_sequence(input, self.weights, self.bias, old_h, old_cell)

    def extra_repr(self) -> str:
        return f"input_features={self.input_features}, state_size={self.state_size}"
