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
``lltm_op::cell_backward_from_new_cell``, recomputes the activations from
what the cell saves (gates, bias and its own output new_cell: no
activations, and not old_cell, which a stateful loop may overwrite in place
after the step) and returns d_gates, d_bias and d_old_cell.

Every autograd feature works: backward; double backward (with
create_graph=True the backward runs as differentiable torch ops, so
gradient penalties work); forward mode (torch.autograd.forward_ad,
torch.func.jvp / jacfwd: an exact JVP in torch ops); torch.func.grad, vjp,
jacrev, hessian and vmap (vmap rules for the cell ops); autocast (the cell
runs in the dtype torch's type promotion gives the pure-PyTorch cell).
"""

from __future__ import annotations

import math
import numbers
import os

import torch
import torch.autograd.forward_ad as _fwad
import torch.nn.functional as F
from torch import Tensor, nn

from . import _runtime

OP = "lltm_op.lltm"
OP_CELL_FORWARD = "lltm_op.cell_forward"
OP_CELL_BACKWARD = "lltm_op.cell_backward"
OP_CELL_BACKWARD_NEW = "lltm_op.cell_backward_from_new_cell"

_runtime.load_library(os.path.dirname(os.path.abspath(__file__)))
_runtime.register_missing_cuda("lltm_op", ["cell_forward", "cell_backward", "cell_backward_from_new_cell"])

_cell_forward = torch.ops.lltm_op.cell_forward.default
_cell_backward = torch.ops.lltm_op.cell_backward.default
_cell_backward_new = torch.ops.lltm_op.cell_backward_from_new_cell.default
_INT64_MAX = 2**63 - 1

_FLOATING = _runtime.FLOATING_DTYPES


# -- argument checks shared by the fake kernels --------------------------------


def _check_same_device(op: str, arg_a: str, a: Tensor, arg_b: str, b: Tensor) -> None:
    # Same message as the C++ check (opscommon/checks.h): "cpu", "cuda:0".
    if a.device != b.device:
        raise RuntimeError(
            f"{op}: arguments '{arg_a}' and '{arg_b}' must be on the same device, got {a.device} and {b.device}"
        )


def _check_cell(op: str, gates: Tensor, bias: Tensor, old_cell: Tensor, cell_arg: str = "old_cell") -> tuple[int, int]:
    # Same checks, order and messages as check_cell_args in csrc/lltm.h.
    _runtime.check_dtype(op, "gates", gates, _FLOATING)
    _runtime.check_dtype(op, "bias", bias, _FLOATING)
    _runtime.check_dtype(op, cell_arg, old_cell, _FLOATING)
    _runtime.check_shape(op, cell_arg, old_cell, (-1, -1))
    batch, state = old_cell.shape
    if isinstance(state, int) and 3 * state > _INT64_MAX:
        raise RuntimeError(
            f"{op}: argument '{cell_arg}' has {state} columns (the state size); 3 times that overflows int64"
        )
    _runtime.check_shape(op, "gates", gates, (batch, 3 * state))
    _runtime.check_shape(op, "bias", bias, (3 * state,))
    _runtime.check_same_dtype(op, "gates", gates, "bias", bias)
    _runtime.check_same_dtype(op, "gates", gates, cell_arg, old_cell)
    _check_same_device(op, "gates", gates, "bias", bias)
    _check_same_device(op, "gates", gates, cell_arg, old_cell)
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


def _backward_fake(op: str, cell_arg: str, grad_h, grad_cell, gates, bias, cell):
    batch, state = _check_cell(op, gates, bias, cell, cell_arg)
    _check_grad(op, "grad_h", grad_h, gates, batch, state)
    _check_grad(op, "grad_cell", grad_cell, gates, batch, state)
    return (
        gates.new_empty((batch, 3 * state)),
        gates.new_empty((3 * state,)),
        gates.new_empty((batch, state)),
    )


@torch.library.register_fake("lltm_op::cell_backward")
def _cell_backward_fake(
    grad_h: Tensor | None, grad_cell: Tensor | None, gates: Tensor, bias: Tensor, old_cell: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_fake(OP_CELL_BACKWARD, "old_cell", grad_h, grad_cell, gates, bias, old_cell)


@torch.library.register_fake("lltm_op::cell_backward_from_new_cell")
def _cell_backward_new_fake(
    grad_h: Tensor | None, grad_cell: Tensor | None, gates: Tensor, bias: Tensor, new_cell: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_fake(OP_CELL_BACKWARD_NEW, "new_cell", grad_h, grad_cell, gates, bias, new_cell)


# -- the cell's math in torch ops ------------------------------------------------------
# The derivatives that no kernel computes: the JVP, and the backward when it
# must itself be differentiable (double backward, torch.func). Any leading
# batch dimensions (vmap rules); the half types compute in float32, as the
# kernels do.


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _activations(gates: Tensor, bias: Tensor):
    """i, o, z = elu(gz) and elu'(gz) of the pre-activations gates + bias."""
    acc = _acc_dtype(gates.dtype)
    gi, go, gz = (gates.to(acc) + bias.to(acc)).chunk(3, dim=-1)
    i, o = torch.sigmoid(gi), torch.sigmoid(go)
    # elu'(x) = 1 for x > 0, exp(x) below: exp(min(x, 0)), whose own
    # derivative is right too (double backward).
    return i, o, F.elu(gz), torch.exp(torch.clamp(gz, max=0))


def _cell_backward_torch(
    grad_h: Tensor | None,
    grad_cell: Tensor | None,
    gates: Tensor,
    bias: Tensor,
    cell: Tensor,
    from_new_cell: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """cell_backward (cell = old_cell) or cell_backward_from_new_cell
    (cell = new_cell) as differentiable torch ops."""
    dtype, acc = gates.dtype, _acc_dtype(gates.dtype)
    i, o, z, dz = _activations(gates, bias)
    c = cell.to(acc)
    t = torch.tanh(c if from_new_cell else c + z * i)
    d_c = grad_cell.to(acc) if grad_cell is not None else None
    if grad_h is not None:
        gh = grad_h.to(acc)
        from_h = gh * o * (1 - t * t)
        d_c = from_h if d_c is None else d_c + from_h
        d_go = gh * t * (o * (1 - o))
    else:
        d_go = torch.zeros_like(o)
    if d_c is None:
        d_c = torch.zeros_like(t)
    d_gates = torch.cat((d_c * z * (i * (1 - i)), d_go, d_c * i * dz), dim=-1)
    return d_gates.to(dtype), d_gates.sum(dim=-2).to(dtype), d_c.to(dtype)


def _cell_jvp_torch(
    gates: Tensor,
    bias: Tensor,
    new_cell: Tensor,
    t_gates: Tensor | None,
    t_bias: Tensor | None,
    t_old_cell: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Tangents of (new_h, new_cell) from those of (gates, bias, old_cell)."""
    dtype, acc = gates.dtype, _acc_dtype(gates.dtype)
    i, o, z, dz = _activations(gates, bias)
    t = torch.tanh(new_cell.to(acc))
    t_new_c = t_old_cell.to(acc) if t_old_cell is not None else None
    t_go = None
    if t_gates is not None or t_bias is not None:
        if t_gates is None:
            t_pre = t_bias.to(acc)
        elif t_bias is None:
            t_pre = t_gates.to(acc)
        else:
            t_pre = t_gates.to(acc) + t_bias.to(acc)
        t_gi, t_go, t_gz = t_pre.chunk(3, dim=-1)
        from_gates = z * (i * (1 - i)) * t_gi + i * dz * t_gz
        t_new_c = from_gates if t_new_c is None else t_new_c + from_gates
    t_new_h = o * (1 - t * t) * t_new_c
    if t_go is not None:
        t_new_h = t_new_h + t * (o * (1 - o)) * t_go
    # Broadcast to the outputs' shape (a tangent of the bias alone has none
    # of the batch).
    t_new_h = t_new_h.expand_as(t).to(dtype)
    t_new_c = t_new_c.expand_as(t).to(dtype)
    return t_new_h, t_new_c


# -- autograd of the cell ops ----------------------------------------------------------

_grad_enabled = torch.is_grad_enabled
_functorch_active = _runtime.functorch_active
_is_compiling = torch.compiler.is_compiling


# The kernels below the Python autograd kernels (no autograd recorded).
_cell_forward_below_autograd = _runtime.below_autograd_caller(_cell_forward)
_cell_backward_new_below_autograd = _runtime.below_autograd_caller(_cell_backward_new)


def _derivative_of_backward_needed() -> bool:
    # create_graph=True (double backward, gradient penalties), torch.func
    # (hessian, jacrev of grad, vmap over the backward) or forward AD
    # (forward-over-reverse): the backward must be differentiable itself.
    return _grad_enabled() or _fwad._current_level >= 0 or _functorch_active()


class _CellFunction(torch.autograd.Function):
    """The autograd of lltm_op::cell_forward: reverse mode (the fused
    backward kernel; torch ops when the backward must be differentiable)
    and forward mode (an exact JVP), at any torch.func level (vmap levels
    use the vmap rules below).

    Saved: gates, bias and new_cell (an output): not old_cell, which a
    stateful loop may overwrite in place (``c.copy_(new_c)``) before the
    backward, as it may with the pure-PyTorch cell."""

    @staticmethod
    def forward(ctx, gates: Tensor, bias: Tensor, old_cell: Tensor) -> tuple[Tensor, Tensor]:
        new_h, new_cell = _cell_forward_below_autograd(gates, bias, old_cell)
        ctx.save_for_backward(gates, bias, new_cell)
        if _fwad._current_level >= 0 or _functorch_active():
            ctx.save_for_forward(gates, bias, new_cell)
        # A gradient autograd does not have (only new_h or only new_cell used)
        # stays None and the kernel reads it as zero: no zero tensor is made.
        ctx.set_materialize_grads(False)
        return new_h, new_cell

    @staticmethod
    def backward(ctx, grad_h: Tensor | None, grad_cell: Tensor | None):
        if grad_h is None and grad_cell is None:
            return None, None, None
        gates, bias, new_cell = ctx.saved_tensors
        if _derivative_of_backward_needed():
            d_gates, d_bias, d_old_cell = _cell_backward_torch(grad_h, grad_cell, gates, bias, new_cell, True)
        else:
            d_gates, d_bias, d_old_cell = _cell_backward_new_below_autograd(grad_h, grad_cell, gates, bias, new_cell)
        needs = ctx.needs_input_grad
        return (
            d_gates if needs[0] else None,
            d_bias if needs[1] else None,
            d_old_cell if needs[2] else None,
        )

    @staticmethod
    def jvp(ctx, t_gates: Tensor | None, t_bias: Tensor | None, t_old_cell: Tensor | None):
        gates, bias, new_cell = ctx.saved_tensors
        return _cell_jvp_torch(gates, bias, new_cell, t_gates, t_bias, t_old_cell)


_runtime.register_autograd("lltm_op::cell_forward", _CellFunction)
_cell_apply = _runtime.function_apply(_CellFunction)
# The backward ops are differentiable too: their derivative is that of the
# same math in torch ops (double backward through a direct call of them).
_runtime.register_composite_autograd(
    "lltm_op::cell_backward",
    lambda gh, gc, gates, bias, old_cell: _cell_backward_torch(gh, gc, gates, bias, old_cell, False),
)
_runtime.register_composite_autograd(
    "lltm_op::cell_backward_from_new_cell",
    lambda gh, gc, gates, bias, new_cell: _cell_backward_torch(gh, gc, gates, bias, new_cell, True),
)


# -- vmap rules ---------------------------------------------------------------------------
# Batched operands go to the front; with an unbatched bias the batch folds
# into the kernels' rows (one call), else the torch-op math runs.


def _to_front(info, t: Tensor | None, dim: int | None) -> Tensor | None:
    if t is None:
        return None
    if dim is None:
        return t.expand(info.batch_size, *t.shape)
    return t.movedim(dim, 0)


def _cell_forward_vmap(info, in_dims, gates, bias, old_cell):
    n = info.batch_size
    g, c = _to_front(info, gates, in_dims[0]), _to_front(info, old_cell, in_dims[2])
    if in_dims[1] is None:
        batch, state = c.shape[1], c.shape[2]
        new_h, new_c = _cell_forward(g.reshape(n * batch, 3 * state), bias, c.reshape(n * batch, state))
        return (new_h.view(n, batch, state), new_c.view(n, batch, state)), (0, 0)
    b = _to_front(info, bias, in_dims[1]).unsqueeze(1)
    dtype, acc = gates.dtype, _acc_dtype(gates.dtype)
    i, o, z, _ = _activations(g, b)
    new_c = c.to(acc) + z * i
    return ((torch.tanh(new_c) * o).to(dtype), new_c.to(dtype)), (0, 0)


def _backward_vmap(op, from_new_cell: bool):
    def rule(info, in_dims, grad_h, grad_cell, gates, bias, cell):
        n = info.batch_size
        gh, gc = _to_front(info, grad_h, in_dims[0]), _to_front(info, grad_cell, in_dims[1])
        g, c = _to_front(info, gates, in_dims[2]), _to_front(info, cell, in_dims[4])
        if in_dims[3] is None:
            batch, state = c.shape[1], c.shape[2]

            def rows(t, width):
                return None if t is None else t.reshape(n * batch, width)

            d_gates, _, d_old_c = op(rows(gh, state), rows(gc, state), rows(g, 3 * state), bias, rows(c, state))
            d_gates = d_gates.view(n, batch, 3 * state)
            d_bias = d_gates.to(_acc_dtype(d_gates.dtype)).sum(dim=1).to(d_gates.dtype)
            return (d_gates, d_bias, d_old_c.view(n, batch, state)), (0, 0, 0)
        b = _to_front(info, bias, in_dims[3]).unsqueeze(1)
        d_gates, _, d_old_c = _cell_backward_torch(gh, gc, g, b, c, from_new_cell)
        d_bias = d_gates.to(_acc_dtype(d_gates.dtype)).sum(dim=1).to(d_gates.dtype)
        return (d_gates, d_bias, d_old_c), (0, 0, 0)

    return rule


torch.library.register_vmap("lltm_op::cell_forward", _cell_forward_vmap)
torch.library.register_vmap("lltm_op::cell_backward", _backward_vmap(_cell_backward, False))
torch.library.register_vmap("lltm_op::cell_backward_from_new_cell", _backward_vmap(_cell_backward_new, True))


def _cell(gates: Tensor, bias: Tensor, old_cell: Tensor) -> tuple[Tensor, Tensor]:
    if _is_compiling() or _functorch_active():
        # torch.compile traces the registered op (and its registered
        # autograd); torch.func transforms run that autograd and the vmap
        # rules level by level.
        return _cell_forward(gates, bias, old_cell)
    if (
        _grad_enabled() and (gates.requires_grad or bias.requires_grad or old_cell.requires_grad)
    ) or _fwad._current_level >= 0:
        # Straight to the Function: the op's Python autograd kernel would
        # only add a dispatcher round trip.
        return _cell_apply(gates, bias, old_cell)
    return _cell_forward_below_autograd(gates, bias, old_cell)


# -- the public function -----------------------------------------------------------


def _autocast_on(device: torch.device) -> bool:
    # False on meta tensors (torch.is_autocast_enabled("meta") raises).
    return _runtime.autocast_enabled(device.type)


def _explain_bad_args(input, weights, bias, old_h, old_cell) -> None:
    """Raise the error that names the first offending argument."""
    args = {"input": input, "weights": weights, "bias": bias, "old_h": old_h, "old_cell": old_cell}
    for name, t in args.items():
        _runtime.check_tensor(OP, name, t)
    _runtime.check_dtype(OP, "input", input, _FLOATING)
    # Under autocast, floating dtypes may differ, as the pure-PyTorch cell
    # allows (an input from an autocast layer in bfloat16, float32 weights).
    mixed_ok = _autocast_on(input.device)
    for name, t in args.items():
        if name != "input":
            if mixed_ok:
                _runtime.check_dtype(OP, name, t, _FLOATING)
            else:
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
    kernels); any strides. Under ``torch.autocast`` the dtypes may differ,
    as in the pure-PyTorch cell (:func:`lltm_reference`): the matrix product
    runs in the autocast dtype and the cell in the dtype type promotion gives
    that cell (``promote_types(autocast dtype, old_cell.dtype)``).

    Returns:
        ``(new_h, new_cell)``, both ``[B, S]``, contiguous, differentiable
        with respect to all five inputs: backward, double backward
        (``create_graph=True``), forward mode (``torch.func.jvp``, dual
        tensors) and ``torch.func`` transforms (grad, vjp, jacrev, jacfwd,
        hessian, vmap). The backward does not read ``old_cell``, so the
        caller may overwrite it in place (a state buffer) after the call.
    """
    if not _args_ok(input, weights, bias, old_h, old_cell):
        _explain_bad_args(input, weights, bias, old_h, old_cell)
    gates = torch.mm(torch.cat((old_h, input), 1), weights.t())
    dtype = old_cell.dtype
    if gates.dtype is not dtype or bias.dtype is not dtype:
        # Autocast: the product came back in the autocast dtype (or the
        # arguments' dtypes differ). The pure-PyTorch cell's outputs have the
        # dtype of old_cell + candidate * input_gate, the candidate and gates
        # being in the product's dtype: run the cell in that dtype.
        dtype = torch.promote_types(gates.dtype, dtype)
        gates, bias, old_cell = gates.to(dtype), bias.to(dtype), old_cell.to(dtype)
    return _cell(gates, bias, old_cell)


def _check_size(name: str, value, minimum: int, module: str = "LLTM") -> int:
    # As nn.LSTM / nn.Linear check theirs: an int (not a bool), at least minimum.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{module}: {name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{module}: {name} must be {'positive' if minimum else 'non-negative'}, got {value}")
    return int(value)


class LLTM(nn.Module):
    """The LLTM recurrent cell: an LSTM-like cell with no forget gate and an
    ELU candidate, as in the PyTorch C++/CUDA extension tutorial.

    ``forward(input, (h, c))`` returns ``(new_h, new_c)``.
    """

    def __init__(self, input_features: int, state_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.input_features = _check_size("input_features", input_features, 0)
        self.state_size = _check_size("state_size", state_size, 1)
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
