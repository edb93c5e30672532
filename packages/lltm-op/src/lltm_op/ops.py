"""Python side of lltm_op: fake kernels and autograd of the fused cell ops,
argument checks, the public ``lltm`` function and the ``LLTM`` module.

Data flow of one step (B = batch, F = input features, S = state size):

    X     = cat([old_h, input], 1)                  # [B, S+F]   torch
    gates = mm(X, weights.t())                      # [B, 3S]    torch (cuBLAS)
    new_h, new_cell = lltm_op::cell_forward(gates, bias, old_cell)   # one kernel

The bias is added inside the cell kernel (it costs nothing there) so that its
gradient, the sum of d_gates over the batch, comes out of the backward
kernel's own pass instead of a second read of d_gates. Autograd: torch
differentiates cat and mm (dX, dW); the cell's backward,
``lltm_op::cell_backward``, recomputes the activations from what the cell
saves (gates, bias, old_cell: no activations) and returns d_gates, d_bias
and d_old_cell.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor, nn

from . import _runtime

OP = "lltm_op.lltm"
OP_CELL_FORWARD = "lltm_op.cell_forward"
OP_CELL_BACKWARD = "lltm_op.cell_backward"

_runtime.load_library(os.path.dirname(os.path.abspath(__file__)))
_runtime.register_missing_cuda("lltm_op", ["cell_forward", "cell_backward"])

_cell_forward = torch.ops.lltm_op.cell_forward.default
_cell_backward = torch.ops.lltm_op.cell_backward.default

_FLOATING = _runtime.FLOATING_DTYPES


# -- argument checks shared by the fake kernels --------------------------------


def _check_same_device(op: str, arg_a: str, a: Tensor, arg_b: str, b: Tensor) -> None:
    # Same message as the C++ check (opscommon/checks.h): "cpu", "cuda:0".
    if a.device != b.device:
        raise RuntimeError(
            f"{op}: arguments '{arg_a}' and '{arg_b}' must be on the same device, got "
            f"{a.device} and {b.device}"
        )


def _check_cell(op: str, gates: Tensor, bias: Tensor, old_cell: Tensor) -> tuple[int, int]:
    # Same checks, order and messages as check_cell_args in csrc/lltm.h.
    _runtime.check_dtype(op, "gates", gates, _FLOATING)
    _runtime.check_dtype(op, "bias", bias, _FLOATING)
    _runtime.check_dtype(op, "old_cell", old_cell, _FLOATING)
    _runtime.check_shape(op, "old_cell", old_cell, (-1, -1))
    batch, state = old_cell.shape
    _runtime.check_shape(op, "gates", gates, (batch, 3 * state))
    _runtime.check_shape(op, "bias", bias, (3 * state,))
    _runtime.check_same_dtype(op, "gates", gates, "bias", bias)
    _runtime.check_same_dtype(op, "gates", gates, "old_cell", old_cell)
    _check_same_device(op, "gates", gates, "bias", bias)
    _check_same_device(op, "gates", gates, "old_cell", old_cell)
    return batch, state


def _check_grad(op: str, arg: str, grad: Tensor | None, gates: Tensor, batch: int, state: int) -> None:
    if grad is None:
        return
    _runtime.check_dtype(op, arg, grad, _FLOATING)
    _runtime.check_shape(op, arg, grad, (batch, state))
    _runtime.check_same_dtype(op, "gates", gates, arg, grad)
    _check_same_device(op, "gates", gates, arg, grad)


# -- fake kernels (shapes only: torch.compile, export, meta tensors) ------------


@torch.library.register_fake("lltm_op::cell_forward")
def _cell_forward_fake(gates: Tensor, bias: Tensor, old_cell: Tensor) -> tuple[Tensor, Tensor]:
    batch, state = _check_cell(OP_CELL_FORWARD, gates, bias, old_cell)
    return gates.new_empty((batch, state)), gates.new_empty((batch, state))


@torch.library.register_fake("lltm_op::cell_backward")
def _cell_backward_fake(
    grad_h: Tensor | None, grad_cell: Tensor | None, gates: Tensor, bias: Tensor, old_cell: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    batch, state = _check_cell(OP_CELL_BACKWARD, gates, bias, old_cell)
    _check_grad(OP_CELL_BACKWARD, "grad_h", grad_h, gates, batch, state)
    _check_grad(OP_CELL_BACKWARD, "grad_cell", grad_cell, gates, batch, state)
    return (
        gates.new_empty((batch, 3 * state)),
        gates.new_empty((3 * state,)),
        gates.new_empty((batch, state)),
    )


# -- autograd of cell_forward ----------------------------------------------------


def _cell_setup_context(ctx, inputs, output) -> None:
    gates, bias, old_cell = inputs
    # The kernel's own inputs are all the backward needs: it recomputes the
    # gates, sigmoid, ELU and tanh instead of keeping them.
    ctx.save_for_backward(gates, bias, old_cell)
    # A gradient autograd does not have (only new_h or only new_cell used)
    # stays None and the kernel reads it as zero: no zero tensor is made.
    ctx.set_materialize_grads(False)


def _cell_backward_formula(ctx, grad_h: Tensor | None, grad_cell: Tensor | None):
    if grad_h is None and grad_cell is None:
        return None, None, None
    gates, bias, old_cell = ctx.saved_tensors
    d_gates, d_bias, d_old_cell = _cell_backward(grad_h, grad_cell, gates, bias, old_cell)
    needs = ctx.needs_input_grad
    return d_gates, (d_bias if needs[1] else None), (d_old_cell if needs[2] else None)


torch.library.register_autograd(
    "lltm_op::cell_forward", _cell_backward_formula, setup_context=_cell_setup_context
)

_below_autograd = torch._C._AutoDispatchBelowAutograd


class _CellFunction(torch.autograd.Function):
    """The eager fast path to the same forward, backward and saved tensors.

    Calling the op through the dispatcher runs the Python autograd kernel that
    register_autograd installs (argument normalisation, a generated Function,
    a redispatch) on every step; this Function calls the kernel directly,
    below autograd, and is several microseconds cheaper per call, which
    matters where the cell is launch-bound. torch.compile traces the op
    itself (see lltm) and gets the registered autograd above.
    """

    @staticmethod
    def forward(ctx, gates: Tensor, bias: Tensor, old_cell: Tensor) -> tuple[Tensor, Tensor]:
        with _below_autograd():
            out = _cell_forward(gates, bias, old_cell)
        _cell_setup_context(ctx, (gates, bias, old_cell), out)
        return out

    backward = staticmethod(_cell_backward_formula)


def _cell(gates: Tensor, bias: Tensor, old_cell: Tensor) -> tuple[Tensor, Tensor]:
    if torch.compiler.is_compiling():
        return _cell_forward(gates, bias, old_cell)
    if torch.is_grad_enabled() and (gates.requires_grad or bias.requires_grad or old_cell.requires_grad):
        return _CellFunction.apply(gates, bias, old_cell)
    with _below_autograd():
        return _cell_forward(gates, bias, old_cell)


# -- the public function -----------------------------------------------------------


def _explain_bad_args(input, weights, bias, old_h, old_cell) -> None:
    """Raise the error that names the first offending argument."""
    args = {"input": input, "weights": weights, "bias": bias, "old_h": old_h, "old_cell": old_cell}
    for name, t in args.items():
        _runtime.check_tensor(OP, name, t)
    _runtime.check_dtype(OP, "input", input, _FLOATING)
    for name, t in args.items():
        if name != "input":
            _runtime.check_same_dtype(OP, "input", input, name, t)
    for name, t in args.items():
        if name != "input":
            _check_same_device(OP, "input", input, name, t)
    _runtime.check_shape(OP, "input", input, (-1, -1))
    batch, features = input.shape
    _runtime.check_shape(OP, "old_h", old_h, (batch, -1))
    state = old_h.shape[1]
    _runtime.check_shape(OP, "old_cell", old_cell, (batch, state))
    _runtime.check_shape(OP, "weights", weights, (3 * state, state + features))
    _runtime.check_shape(OP, "bias", bias, (3 * state,))


def _args_ok(input, weights, bias, old_h, old_cell) -> bool:
    # Cheap attribute reads only; any doubt goes to _explain_bad_args.
    if not (
        isinstance(input, Tensor)
        and isinstance(weights, Tensor)
        and isinstance(bias, Tensor)
        and isinstance(old_h, Tensor)
        and isinstance(old_cell, Tensor)
        and input.dim() == 2
        and old_h.dim() == 2
    ):
        return False
    dtype = input.dtype
    device = input.device
    batch, features = input.shape
    state = old_h.shape[1]
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
        and old_h.shape[0] == batch
        and old_cell.shape == (batch, state)
        and weights.shape == (3 * state, state + features)
        and bias.shape == (3 * state,)
    )


def lltm(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor, old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """One step of the LLTM cell.

    Args:
        input: ``[B, F]``, the step's input.
        weights: ``[3*S, S+F]``, rows of the input gate, output gate and
            candidate cell, columns multiplying ``[old_h, input]``.
        bias: ``[3*S]``.
        old_h: ``[B, S]``, the previous hidden state.
        old_cell: ``[B, S]``, the previous cell state.

    All five on one device (CPU or CUDA), one dtype (float16, bfloat16,
    float32 or float64; the half types compute in float32 inside the cell
    kernels); any strides.

    Returns:
        ``(new_h, new_cell)``, both ``[B, S]``, contiguous, differentiable
        with respect to all five inputs.
    """
    if not _args_ok(input, weights, bias, old_h, old_cell):
        _explain_bad_args(input, weights, bias, old_h, old_cell)
    gates = torch.mm(torch.cat((old_h, input), 1), weights.t())
    if gates.dtype is not bias.dtype:
        # Under autocast the product comes back in the autocast dtype: the
        # cell then runs in the parameters' dtype (as torch's elementwise
        # type promotion would), differentiably.
        gates = gates.to(bias.dtype)
    return _cell(gates, bias, old_cell)


class LLTM(nn.Module):
    """The LLTM recurrent cell: an LSTM-like cell with no forget gate and an
    ELU candidate, as in the PyTorch C++/CUDA extension tutorial.

    ``forward(input, (h, c))`` returns ``(new_h, new_c)``.
    """

    def __init__(self, input_features: int, state_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.input_features = input_features
        self.state_size = state_size
        factory = {"device": device, "dtype": dtype}
        # 3 * state_size rows: input gate, output gate, candidate cell; the
        # columns multiply [old_h, input].
        self.weights = nn.Parameter(torch.empty(3 * state_size, input_features + state_size, **factory))
        self.bias = nn.Parameter(torch.empty(3 * state_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.state_size)
        for weight in self.parameters():
            nn.init.uniform_(weight, -stdv, +stdv)

    def forward(self, input: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        old_h, old_cell = state
        return lltm(input, self.weights, self.bias, old_h, old_cell)

    def extra_repr(self) -> str:
        return f"input_features={self.input_features}, state_size={self.state_size}"
