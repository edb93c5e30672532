"""The LLTM over whole sequences: ``lltm_sequence`` (what the ``LLTMSequence``
module of rnn.py runs for each layer and direction), on the fused multi-step ops ``lltm_op::sequence_forward`` and
``lltm_op::sequence_backward``, and ``lltm_op::sequence_inference`` (the forward with nothing kept for a backward)
where no gradient can be asked for.

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

import weakref

import torch
from torch import Tensor

from . import _runtime
from . import ops as _ops  # loads the compiled library

OP = "lltm_op.lltm_sequence"
OP_FORWARD = "lltm_op.sequence_forward"
OP_BACKWARD = "lltm_op.sequence_backward"
OP_INFERENCE = "lltm_op.sequence_inference"

_runtime.register_missing_cuda("lltm_op", ["sequence_forward", "sequence_backward", "sequence_inference"])

_seq_forward = torch.ops.lltm_op.sequence_forward.default
_seq_backward = torch.ops.lltm_op.sequence_backward.default
_seq_inference = torch.ops.lltm_op.sequence_inference.default

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


def _step_rows(op: str, batch_sizes, T: int, B: int) -> list[int]:
    """The rows each step runs: all B, or the first batch_sizes[t] (checked
    as the kernel checks them: non-increasing, in [0, B])."""
    if batch_sizes is None:
        return [B] * T
    _check_batch_sizes(op, batch_sizes, T)
    sizes, before = batch_sizes.tolist(), B
    for t, n in enumerate(sizes):
        if not 0 <= n <= before:
            raise RuntimeError(
                f"{op}: argument 'batch_sizes' must hold non-increasing sizes in [0, {B}] (the batch), "
                f"got {n} at step {t}"
            )
        before = n
    return sizes


def _check_batch_sizes(op: str, batch_sizes, T) -> None:
    # Its values are checked by the kernel (a fake tensor has none).
    if batch_sizes is None:
        return
    if batch_sizes.device.type != "cpu" or batch_sizes.dtype != torch.int64:
        raise RuntimeError(f"{op}: argument 'batch_sizes' must be an int64 CPU tensor (a PackedSequence's batch_sizes)")
    _runtime.check_shape(op, "batch_sizes", batch_sizes, (T,))


# -- fake kernels ---------------------------------------------------------------------


@torch.library.register_fake("lltm_op::sequence_forward")
def _sequence_forward_fake(input, weights, bias, old_h, old_cell, allow_tf32=False, batch_sizes=None):
    T, B, F, S = _check_forward(OP_FORWARD, input, weights, bias, old_h, old_cell)
    _check_batch_sizes(OP_FORWARD, batch_sizes, T)
    return (
        input.new_empty((T, B, S)),
        input.new_empty((B, S)),
        input.new_empty((B, S)),
        input.new_empty((T, B, 3 * S)),
        input.new_empty((T, B, S)),
    )


@torch.library.register_fake("lltm_op::sequence_inference")
def _sequence_inference_fake(input, weights, bias, old_h, old_cell, allow_tf32=False, batch_sizes=None):
    T, B, F, S = _check_forward(OP_INFERENCE, input, weights, bias, old_h, old_cell)
    _check_batch_sizes(OP_INFERENCE, batch_sizes, T)
    return input.new_empty((T, B, S)), input.new_empty((B, S)), input.new_empty((B, S))


@torch.library.register_fake("lltm_op::sequence_backward")
def _sequence_backward_fake(
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
    input_grad,
    allow_tf32=False,
    batch_sizes=None,
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
    _check_batch_sizes(op, batch_sizes, T)
    return (
        input.new_empty((T, B, F) if input_grad else (0,)),
        input.new_empty((3 * S, S + F)),
        input.new_empty((3 * S,)),
        input.new_empty((B, S)),
        input.new_empty((B, S)),
    )


# -- the sequence's derivatives in torch ops -----------------------------------------------
# What no kernel computes: the tangents (forward mode) and the derivative of
# the backward op itself (a direct call of sequence_backward on tensors that
# require grad), step by step through the cell's exact math (ops.py). The
# saved pre-activations already hold the bias: the cell's bias is zero here.


def _sequence_jvp_torch(input, weights, old_h, outputs, gates, cells, t_input, t_weights, t_bias, t_old_h, t_old_cell):
    """Tangents of (outputs, h_n, c_n) from those of the five arguments
    (None: zero), any of them batched (torch.func.jacfwd)."""
    T, B, _ = input.shape
    S = old_h.shape[-1]
    w_h, w_x = weights[:, :S], weights[:, S:]
    zero_bias = gates.new_zeros(3 * S)
    # The pre-activations' tangent from the input and W_x: all steps at once.
    t_pre = None
    if t_input is not None:
        t_pre = t_input @ w_x.mT
    if t_weights is not None:
        t_w_h, t_w_x = t_weights[..., :S], t_weights[..., S:]
        from_w = input @ t_w_x.mT
        t_pre = from_w if t_pre is None else t_pre + from_w
    th = t_old_h if t_old_h is not None else old_h.new_zeros(B, S)
    tc = t_old_cell if t_old_cell is not None else old_h.new_zeros(B, S)
    outs = []
    for t in range(T):
        tg = th @ w_h.mT
        if t_pre is not None:
            tg = tg + t_pre[t]
        if t_weights is not None:
            tg = tg + (outputs[t - 1] if t else old_h) @ t_w_h.mT
        if t_bias is not None:
            tg = tg + t_bias
        th, tc = _ops._cell_jvp_torch(gates[t], zero_bias, cells[t], tg, None, tc)
        outs.append(th)
    if not outs:
        return torch.zeros_like(outputs), th.clone(), tc.clone()
    return torch.stack(outs), th, tc


def _sequence_backward_torch(
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
    input_grad,
    allow_tf32=False,
    batch_sizes=None,
):
    """lltm_op::sequence_backward as differentiable torch ops (what its
    kernel computes, from the same arguments, a packed run's included)."""
    T, B, F = input.shape
    S = old_h.shape[1]
    w_h, w_x = weights[:, :S], weights[:, S:]
    zero_bias = gates.new_zeros(3 * S)
    sizes = _step_rows(OP_BACKWARD, batch_sizes, T, B)
    # Running gradients of every row's h and c: a row past its last step
    # (a packed run) keeps grad_h_n / grad_c_n until that step reads them.
    dh = grad_h_n if grad_h_n is not None else old_h.new_zeros(B, S)
    dc = grad_c_n if grad_c_n is not None else old_h.new_zeros(B, S)
    d_gates = [None] * T
    for t in reversed(range(T)):
        n = sizes[t]
        g = dh[:n] if grad_outputs is None else dh[:n] + grad_outputs[t, :n]
        c_prev = (cells[t - 1] if t else old_cell)[:n]
        dg, _, dc_rows = _ops._cell_backward_torch(g, dc[:n], gates[t, :n], zero_bias, c_prev, False)
        if n == B:
            d_gates[t], dh, dc = dg, dg @ w_h, dc_rows
        else:
            d_gates[t] = torch.cat((dg, dg.new_zeros(B - n, 3 * S)))
            dh, dc = torch.cat((dg @ w_h, dh[n:])), torch.cat((dc_rows, dc[n:]))
    dG = torch.stack(d_gates) if T else gates.new_zeros(0, B, 3 * S)
    h_prev = torch.cat((old_h.unsqueeze(0), outputs[:-1])) if T else outputs
    d_weights = torch.cat((torch.einsum("tbg,tbs->gs", dG, h_prev), torch.einsum("tbg,tbf->gf", dG, input)), 1)
    d_input = dG @ w_x if input_grad else input.new_empty(0)
    return d_input, d_weights, dG.sum((0, 1)), dh.clone(), dc.clone()


_runtime.register_composite_autograd("lltm_op::sequence_backward", _sequence_backward_torch)


# -- autograd: one node for the whole sequence -------------------------------------------

_seq_forward_below_autograd = _runtime.below_autograd_caller(_seq_forward)
_seq_backward_below_autograd = _runtime.below_autograd_caller(_seq_backward)
_forward_ad_active = _runtime.forward_ad_active
_functorch_active = _runtime.functorch_active


class _NoDoubleBackward(torch.autograd.Function):
    """Passes the first-order gradients through (copies) when autograd builds
    a graph of them (create_graph=True; torch.func's grad and vjp always do)
    or forward AD may ask for their tangents, connected to what they depend
    on, and refuses to be differentiated: a second derivative through
    lltm_sequence is an error, never a silent zero."""

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

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(
            f"{OP}: second derivatives are not supported: the gradients of lltm_sequence have no "
            "tangents (forward-over-reverse, e.g. torch.func.hessian or jacfwd of a gradient); "
            "first derivatives work in either mode"
        )


def _saved(ctx):
    try:
        return ctx.saved_tensors
    except RuntimeError as e:
        # autograd's version check: say which argument (input, weights) or
        # result (outputs) was overwritten; old_h and old_cell are copies.
        changed = [
            name
            for name, ref, version in zip(("input", "weights"), ctx.watched, ctx.versions)
            if ref() is not None and ref()._version != version
        ]
        what = f"argument '{changed[0]}'" if changed else "its result 'outputs' (or an argument since freed)"
        raise RuntimeError(
            f"{OP}: {what} was modified in place after the call, and the backward needs it as it "
            f"was; modify a copy (or clone it before the call). ({e})"
        ) from e


def _backward(ctx, grad_outputs, grad_h_n, grad_c_n, _grad_gates=None, _grad_cells=None):
    needs = ctx.needs_input_grad
    if (grad_outputs is None and grad_h_n is None and grad_c_n is None) or not any(needs):
        return None, None, None, None, None, None, None
    input, weights, old_h, old_cell, outputs, gates, cells = _saved(ctx)
    # Below autograd: the fused kernel (the op's own derivative, torch ops,
    # is for direct calls; see _NoDoubleBackward for this one's).
    d_input, d_weights, d_bias, d_old_h, d_old_cell = _seq_backward_below_autograd(
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
        ctx.allow_tf32,
        ctx.batch_sizes,
    )
    grads = [
        d_input if needs[0] else None,
        d_weights if needs[1] else None,
        d_bias if needs[2] else None,
        d_old_h if needs[3] else None,
        d_old_cell if needs[4] else None,
    ]
    if torch.is_grad_enabled() or _forward_ad_active():
        present = [k for k, g in enumerate(grads) if g is not None]
        deps = [t for t in (input, weights, old_h, old_cell, grad_outputs, grad_h_n, grad_c_n) if t is not None]
        wrapped = _NoDoubleBackward.apply(len(present), *(grads[k] for k in present), *deps)
        for k, g in zip(present, wrapped):
            grads[k] = g
    return (*grads, None, None)  # allow_tf32, batch_sizes: no gradient


class _SequenceFunction(torch.autograd.Function):
    """The autograd of lltm_op::sequence_forward, registered as the op's own
    (an exported program's call of the op has it too): one node for the
    whole sequence, reverse mode through the fused backward op, forward mode
    through the exact JVP in torch ops, at any torch.func level (vmap levels
    use the vmap rules below); second derivatives are refused."""

    @staticmethod
    def forward(ctx, input, weights, bias, old_h, old_cell, allow_tf32=False, batch_sizes=None):
        outputs, h_n, c_n, gates, cells = _seq_forward_below_autograd(
            input, weights, bias, old_h, old_cell, allow_tf32, batch_sizes
        )
        # The backward's recurrent products run in the forward's precision,
        # over the same steps.
        ctx.allow_tf32 = allow_tf32
        ctx.batch_sizes = batch_sizes
        # The initial state is saved as copies ([B, S] each): a loop that
        # writes the next state into the buffers it passed (h.copy_(h_n))
        # keeps right gradients, as a loop of cells does. The pre-activations
        # and cell states of every step (the op's last two outputs) plus the
        # h of every step (its first) are all the rest the backward needs.
        h0, c0 = old_h.clone(), old_cell.clone()
        ctx.save_for_backward(input, weights, h0, c0, outputs, gates, cells)
        if _forward_ad_active() or _functorch_active():
            ctx.save_for_forward(input, weights, h0, outputs, gates, cells)
        ctx.watched = (weakref.ref(input), weakref.ref(weights))
        ctx.versions = (input._version, weights._version)
        ctx.mark_non_differentiable(gates, cells)
        ctx.set_materialize_grads(False)
        return outputs, h_n, c_n, gates, cells

    backward = staticmethod(_backward)

    @staticmethod
    def jvp(ctx, t_input, t_weights, t_bias, t_old_h, t_old_cell, _t_allow_tf32=None, _t_batch_sizes=None):
        if ctx.batch_sizes is not None:
            raise RuntimeError(
                f"{OP_FORWARD}: forward-mode AD of a packed run (batch_sizes given) is not supported; "
                "LLTMSequence runs packed input segment by segment under forward AD"
            )
        input, weights, old_h, outputs, gates, cells = ctx.saved_tensors
        t_out, t_h, t_c = _sequence_jvp_torch(
            input, weights, old_h, outputs, gates, cells, t_input, t_weights, t_bias, t_old_h, t_old_cell
        )
        return t_out, t_h, t_c, None, None


_runtime.register_autograd("lltm_op::sequence_forward", _SequenceFunction)
# Outside torch.func: the runtime's apply (Function.apply binds its arguments
# through pytree on every call).
_fast_apply = _runtime.function_apply(_SequenceFunction)


def _vmap_by_loop(op, n_out: int):
    """A batching rule that runs the op once per sample (the batched
    dimension is rarely large for a whole-sequence op; per-sample weight
    gradients, vmap(grad(...)), need one backward per sample anyway)."""

    def rule(info, in_dims, *args):
        size = info.batch_size
        if size == 0:
            # No sample to run: the shapes of one, from the fake kernel.
            device = next(a.device for a in args if isinstance(a, Tensor))
            metas = [
                a.new_empty(a.shape[:d] + a.shape[d + 1 :], device="meta")
                if d is not None
                else (a.to("meta") if isinstance(a, Tensor) else a)
                for a, d in zip(args, in_dims)
            ]
            one = op(*metas)
            return tuple(torch.empty((0, *r.shape), dtype=r.dtype, device=device) for r in one), (0,) * n_out
        results = []
        for n in range(size):
            sliced = [a.select(d, n) if d is not None else a for a, d in zip(args, in_dims)]
            results.append(op(*sliced))
        return tuple(torch.stack([r[k] for r in results]) for k in range(n_out)), (0,) * n_out

    return rule


torch.library.register_vmap("lltm_op::sequence_forward", _vmap_by_loop(_seq_forward, 5))
torch.library.register_vmap("lltm_op::sequence_backward", _vmap_by_loop(_seq_backward, 5))
torch.library.register_vmap("lltm_op::sequence_inference", _vmap_by_loop(_seq_inference, 3))


_seq_inference_below_autograd = _runtime.below_autograd_caller(_seq_inference)


def _not_differentiable() -> RuntimeError:
    return RuntimeError(
        f"{OP_INFERENCE}: not differentiable (it keeps nothing for a backward); call "
        "lltm_op.lltm_sequence, or lltm_op::sequence_forward, where gradients are needed"
    )


class _InferenceFunction(torch.autograd.Function):
    """The autograd of lltm_op::sequence_inference: none. It keeps nothing
    a derivative needs, so a gradient (backward) or a tangent (forward AD,
    torch.func.jvp) asked of it is an error, never a silently missing one.
    lltm_sequence and LLTMSequence call it only where none can be asked."""

    @staticmethod
    def forward(ctx, input, weights, bias, old_h, old_cell, allow_tf32=False, batch_sizes=None):
        return _seq_inference_below_autograd(input, weights, bias, old_h, old_cell, allow_tf32, batch_sizes)

    @staticmethod
    def backward(ctx, *grads):
        raise _not_differentiable()

    @staticmethod
    def jvp(ctx, *tangents):
        raise _not_differentiable()


_runtime.register_autograd("lltm_op::sequence_inference", _InferenceFunction)


def _allow_tf32(input: Tensor) -> bool:
    """Whether the float32 recurrent products may use TF32 tensor cores:
    what torch allows its own float32 matrix products on CUDA
    (``torch.backends.cuda.matmul.allow_tf32``, which
    ``torch.set_float32_matmul_precision("high")`` turns on)."""
    return input.dtype is torch.float32 and input.is_cuda and torch.backends.cuda.matmul.allow_tf32


def _run(input, weights, bias, old_h, old_cell, batch_sizes=None):
    """The op through the right route. ``batch_sizes``: LLTMSequence's packed
    run of one layer and direction, ``input`` the packed batch padded to
    ``[T, B, F]`` (sequences sorted longest first, as a PackedSequence holds
    them), step t running the first ``batch_sizes[t]`` rows only (under
    forward AD the Function's jvp refuses it: never a lost tangent)."""
    tf32 = _allow_tf32(input)
    if torch.compiler.is_compiling() or _functorch_active():
        # torch.compile traces the registered op; torch.func transforms run
        # its registered autograd and vmap rule level by level. (torch 2.11
        # also compiles LLTMSequence's packed call on its own, after falling
        # back to eager in the module's forward.)
        return _seq_forward(input, weights, bias, old_h, old_cell, tf32, batch_sizes)
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
        return _fast_apply(input, weights, bias, old_h, old_cell, tf32, batch_sizes)
    # No gradient can be asked for: the forward that keeps nothing for one.
    outputs, h_n, c_n = _seq_inference_below_autograd(input, weights, bias, old_h, old_cell, tf32, batch_sizes)
    return outputs, h_n, c_n, None, None


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
    bfloat16, float32 or float64); any strides. Under autocast the dtypes
    may differ and the results are those of T calls of :func:`lltm_op.lltm`
    under the same autocast, in their dtypes and precision: the operands of
    the matrix products (input, weights, initial h) are rounded to the
    autocast dtype as autocast rounds them, and the whole sequence runs in
    ``promote_types(autocast dtype, old_cell.dtype)``, so a float32 cell
    state stays float32 (the LLTM has no forget gate: its state grows, and
    kept in bfloat16 it would lose most of its precision over a long
    sequence). A state in the autocast dtype runs it all in that dtype.
    On CUDA, float32's recurrent products follow torch's float32 matmul
    setting: TF32 tensor cores where ``torch.backends.cuda.matmul.allow_tf32``
    is on (``torch.set_float32_matmul_precision("high")``), full float32
    otherwise (torch's default).

    Returns:
        ``(outputs, (h_n, c_n))``: ``outputs`` ``[T, B, S]`` holds the new h of
        every step, ``h_n`` and ``c_n`` ``[B, S]`` the final state (the initial
        one when T is 0); the same as T calls of :func:`lltm_op.lltm`, with
        gradients to all five arguments through every output. One autograd
        node for the whole sequence: backward, forward mode (dual tensors,
        ``torch.func.jvp`` / ``jacfwd``: the exact tangent), ``torch.func``'s
        grad, vjp, jacrev and vmap; second derivatives (double backward,
        hessian) are refused with an error. The backward does not read
        ``old_h`` and ``old_cell`` (it keeps copies): the caller may write the
        next state into them.
    """
    if isinstance(input, Tensor) and _runtime.autocast_enabled(input.device.type):
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
    # What T calls of lltm_op.lltm under this autocast compute: each step's
    # matrix product takes [h, x] and the weights in the autocast dtype
    # (float16, bfloat16 and float32 tensors; float64 ones stay), and the
    # cell runs in promote_types(product dtype, old_cell dtype), which is the
    # dtype of the state it carries to the next step.
    run = torch.promote_types(low, old_cell.dtype) if old_cell.dtype in _AUTOCAST_ELIGIBLE else old_cell.dtype

    def operand(t, rounded: bool):
        if t.dtype not in _AUTOCAST_ELIGIBLE:
            return t
        return (t.to(low) if rounded else t).to(run)

    cast = (
        operand(input, True),
        operand(weights, True),
        operand(bias, False),
        operand(old_h, True),
        operand(old_cell, False),
    )
    with torch.autocast(device_type, enabled=False):
        if not _args_ok(*cast):
            _explain_bad_args(*cast)
        outputs, h_n, c_n, _, _ = _run(*cast)
    return outputs, (h_n, c_n)
