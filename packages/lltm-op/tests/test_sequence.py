"""lltm_op.lltm_sequence (the fused multi-step LLTM) against a loop of the
pure-PyTorch cell: the shared op contract, every gradient in float64 through
every output and the final state, chunked backward, both CUDA paths (fused
step kernels and cuBLAS), autograd features that are refused, autocast,
export, CUDA graphs, memory and the module."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import re

import pytest
import torch
from lltm_op import LLTM, LLTMSequence, lltm, lltm_reference, lltm_sequence
from lltm_op._runtime import BUILD_INFO
from lltm_op.sequence import _run as run_op
from opscommon.testing import DEVICES, BadInput, OpContract, cuda_usable, with_layout

OP = "lltm_op.lltm_sequence"
HALF_DTYPES = (torch.float16, torch.bfloat16)
seq_forward = torch.ops.lltm_op.sequence_forward.default
seq_backward = torch.ops.lltm_op.sequence_backward.default
seq_inference = torch.ops.lltm_op.sequence_inference.default


def need(device: str) -> str:
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    return device


@contextlib.contextmanager
def env(**values):
    """Set environment variables (the ops read LLTM_OP_SEQUENCE_* per call)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_args(T, B, F, S, dtype=torch.float32, device="cpu", generator=None):
    """input, weights, bias, old_h, old_cell, drawn in float64 (gates of
    order one) and rounded to ``dtype``."""
    f64 = dict(dtype=torch.float64, device="cpu", generator=generator)
    fan_in = max(1, S + F)
    args = (
        torch.randn(T, B, F, **f64),
        (torch.rand(3 * S, S + F, **f64) * 2 - 1) * (2.0 / math.sqrt(fan_in)),
        torch.randn(3 * S, **f64) * 0.5,
        torch.randn(B, S, **f64),
        torch.randn(B, S, **f64),
    )
    return tuple(t.to(device=device, dtype=dtype) for t in args)


def reference(input, weights, bias, old_h, old_cell):
    """A loop of the pure-PyTorch cell."""
    h, c = old_h, old_cell
    outs = []
    for t in range(input.shape[0]):
        h, c = lltm_reference(input[t], weights, bias, h, c)
        outs.append(h)
    if outs:
        outputs = torch.stack(outs)
    else:
        outputs = (old_h * 0).unsqueeze(0)[:0]  # [0, B, S], still connected to old_h
    return outputs, (h, c)


def flat(out):
    outputs, (h_n, c_n) = out
    return outputs, h_n, c_n


def reference64(*args):
    return flat(reference(*(t.double() for t in args)))


# rel_err limits against float64 by dtype, and float32's on TF32 tensor
# cores (products of operands rounded to 10-bit mantissas).
LIMITS = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}
TF32_LIMIT = 5e-3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    denom = ref.norm().item()
    err = (out.double() - ref).norm().item()
    return err / denom if denom else err


class TestSequenceContract(OpContract):
    op_name = OP
    build_info = BUILD_INFO
    # (T, B, F, S): one step, batch 1, state sizes off every block width, a
    # state past one block of 32 columns, T = 0, B = 0, S = 0, F = 0.
    cases = [
        (1, 1, 1, 1),
        (3, 2, 3, 5),
        (5, 4, 5, 3),
        (6, 16, 32, 128),
        (4, 3, 7, 33),
        (3, 9, 4, 40),
        (0, 4, 6, 5),
        (3, 0, 4, 6),
        (3, 5, 2, 0),
        (4, 3, 0, 5),
    ]
    grad_cases = [(3, 2, 3, 4), (1, 2, 2, 5), (4, 3, 1, 6)]
    grad_inputs = (0, 1, 2, 3, 4)
    special_values = False  # the matrix products mix every element into whole rows
    # First derivatives in both modes (backward, forward AD, torch.func's
    # vjp/grad/jacrev/jvp/jacfwd, vmap) are right; second derivatives are
    # refused with an error.
    refused_derivatives = ("hessian", "double_backward")
    property_examples = 25
    # 20 chained sequences of 25 steps: 500 steps of state under autocast.
    autocast_case = (25, 4, 8, 16)
    autocast_calls = 20

    def make_inputs(self, case, dtype, device):
        return make_args(*case, dtype=dtype, device=device)

    def call(self, *args):
        return flat(lltm_sequence(*args))

    def autocast_next_inputs(self, inputs, outputs):
        return (*inputs[:3], outputs[1], outputs[2])

    def make_module(self, case, dtype, device):
        T, B, F, S = case
        module = LLTMSequence(F, S, device=device, dtype=dtype)
        return module, (torch.randn(T, B, F, device=device, dtype=dtype),)

    def reference(self, *args):
        if args[0].dtype in HALF_DTYPES:
            return reference64(*args)
        return flat(reference(*args))

    def tolerance(self, dtype):
        return {
            torch.float16: {"atol": 5e-3, "rtol": 5e-3},
            torch.bfloat16: {"atol": 4e-2, "rtol": 4e-2},
        }.get(dtype, {})

    def opcheck_targets(self):
        return [seq_forward]

    @pytest.mark.parametrize("device", DEVICES)
    def test_opcheck(self, device):
        device = self._device(device)
        for dtype in (torch.float32, torch.float64):
            for n, case in enumerate(self.grad_cases):
                args = make_args(*case, dtype=dtype, device=device)
                torch.library.opcheck(seq_forward, tuple(t.clone().requires_grad_() for t in args))
                outputs, h_n, c_n, gates, cells = seq_forward(*args)
                x, w, b, h, c = args
                gs = [torch.randn_like(t) for t in (outputs, h_n, c_n)]
                torch.library.opcheck(seq_backward, (*gs, x, w, h, c, outputs, gates, cells, True))
                if n or dtype != torch.float32:
                    continue
                # Once: no grad, partial grads, strided arguments, absent
                # incoming gradients, no input gradient, T = 0.
                torch.library.opcheck(seq_forward, args)
                torch.library.opcheck(seq_forward, (x, w.clone().requires_grad_(), b, h, c))
                torch.library.opcheck(
                    seq_forward,
                    (
                        with_layout(x, "transposed"),
                        with_layout(w, "strided"),
                        with_layout(b, "offset"),
                        with_layout(h, "transposed"),
                        with_layout(c, "strided"),
                    ),
                )
                for grads in ((gs[0], None, None), (None, gs[1], None), (None, None, gs[2]), (None, None, None)):
                    torch.library.opcheck(seq_backward, (*grads, x, w, h, c, outputs, gates, cells, False))
                empty = make_args(0, 3, 2, 4, dtype=dtype, device=device)
                torch.library.opcheck(seq_forward, tuple(t.clone().requires_grad_() for t in empty))

    def bad_inputs(self, device):
        def args(**replace):
            a = dict(zip(("input", "weights", "bias", "old_h", "old_cell"), make_args(5, 16, 32, 128, device=device)))
            a.update(replace)
            return a

        def call(**replace):
            return lambda: lltm_sequence(**args(**replace))

        other = "meta" if device == "cpu" else "cpu"
        this = "cpu" if device == "cpu" else r"cuda:\d+"
        f32 = dict(device=device)

        def z(*shape, dtype=torch.float32, device=device):
            return torch.zeros(*shape, dtype=dtype, device=device)

        good = make_args(2, 4, 3, 5, device=device)
        return [
            BadInput(
                "bias shape",
                call(bias=torch.zeros(10, **f32)),
                rf"^{OP}: argument 'bias' must have shape \[384\], got \[10\]$",
            ),
            BadInput(
                "weights shape",
                call(weights=torch.zeros(384, 128, **f32)),
                rf"{OP}: argument 'weights' must have shape \[384, 160\], got \[384, 128\]",
            ),
            BadInput(
                "old_h batch",
                call(old_h=torch.zeros(15, 128, **f32)),
                rf"{OP}: argument 'old_h' must have shape \[16, \*\], got \[15, 128\]",
            ),
            BadInput(
                "old_cell state",
                call(old_cell=torch.zeros(16, 127, **f32)),
                rf"{OP}: argument 'old_cell' must have shape \[16, 128\], got \[16, 127\]",
            ),
            BadInput(
                "input 2-D (one step)",
                call(input=torch.zeros(16, 32, **f32)),
                rf"{OP}: argument 'input' must have shape \[\*, \*, \*\], got \[16, 32\]",
            ),
            BadInput(
                "input batch",
                call(input=torch.zeros(5, 15, 32, **f32)),
                rf"{OP}: argument 'old_h' must have shape \[15, \*\], got \[16, 128\]",
            ),
            BadInput(
                "weights dtype",
                call(weights=torch.zeros(384, 160, dtype=torch.float64, device=device)),
                rf"{OP}: arguments 'input' and 'weights' must have the same dtype, got float32 and float64",
            ),
            BadInput(
                "integer input",
                lambda: lltm_sequence(*(t.long() for t in good)),
                rf"{OP}: argument 'input' must be a floating-point tensor .*got int64",
            ),
            BadInput(
                "old_cell device",
                call(old_cell=torch.zeros(16, 128, device=other)),
                rf"{OP}: arguments 'input' and 'old_cell' must be on the same device, got {this} and {other}",
            ),
            BadInput("None", call(old_h=None), rf"{OP}: argument 'old_h' must be a tensor, got NoneType", TypeError),
            # The registered ops check their own arguments (C++ kernels).
            BadInput(
                "sequence_forward weights shape",
                lambda: seq_forward(z(2, 4, 3), z(15, 7), z(15), z(4, 5), z(4, 5)),
                r"lltm_op.sequence_forward: argument 'weights' must have shape \[15, 8\], got \[15, 7\]",
            ),
            BadInput(
                "sequence_forward dtype",
                lambda: seq_forward(z(2, 4, 3), z(15, 8), z(15), z(4, 5, dtype=torch.float64), z(4, 5)),
                r"lltm_op.sequence_forward: arguments 'input' and 'old_h' must have the same dtype, "
                r"got float32 and float64",
            ),
            BadInput(
                "sequence_forward int",
                lambda: seq_forward(z(2, 4, 3, dtype=torch.int32), z(15, 8), z(15), z(4, 5), z(4, 5)),
                r"lltm_op.sequence_forward: argument 'input' must be a floating-point tensor",
            ),
            BadInput(
                "sequence_forward device",
                lambda: seq_forward(z(2, 4, 3), z(15, 8), z(15, device=other), z(4, 5), z(4, 5)),
                rf"lltm_op.sequence_forward: arguments 'input' and 'bias' must be on the same device, "
                rf"got {this} and {other}",
            ),
            BadInput(
                "sequence_backward grad shape",
                lambda: seq_backward(
                    z(2, 4, 4),
                    None,
                    None,
                    z(2, 4, 3),
                    z(15, 8),
                    z(4, 5),
                    z(4, 5),
                    z(2, 4, 5),
                    z(2, 4, 15),
                    z(2, 4, 5),
                    True,
                ),
                r"lltm_op.sequence_backward: argument 'grad_outputs' must have shape \[2, 4, 5\], "
                r"got \[2, 4, 4\]",
            ),
            BadInput(
                "sequence_backward gates shape",
                lambda: seq_backward(
                    None, None, None, z(2, 4, 3), z(15, 8), z(4, 5), z(4, 5), z(2, 4, 5), z(2, 4, 5), z(2, 4, 5), True
                ),
                r"lltm_op.sequence_backward: argument 'gates' must have shape \[2, 4, 15\]",
            ),
            # 3 * S overflows int64: a batch of 0 rows makes old_h that wide.
            BadInput(
                "state size overflows",
                lambda: seq_forward(z(2, 0, 3), z(0, 8), z(0), z(0, 2**62), z(0, 2**62)),
                r"lltm_op.sequence_forward: the state size is too large",
            ),
            # A failed allocation names the op, the buffer and its size: a
            # sequence of 2^40 steps, its input one step expanded.
            BadInput(
                "sequence_forward out of memory",
                lambda: seq_forward(z(1, 1, 3).expand(2**40, 1, 3), z(6, 5), z(6), z(1, 2), z(1, 2)),
                rf"^lltm_op.sequence_forward: could not allocate the outputs, a float32 tensor of shape "
                rf"\[1099511627776, 1, 2\] \(8796093022208 bytes\) on {this} \(out of memory\?\)$",
            ),
            BadInput(
                "sequence_inference out of memory",
                lambda: seq_inference(z(1, 1, 3).expand(2**40, 1, 3), z(6, 5), z(6), z(1, 2), z(1, 2)),
                rf"^lltm_op.sequence_inference: could not allocate the outputs, a float32 tensor of shape "
                rf"\[1099511627776, 1, 2\] \(8796093022208 bytes\) on {this} \(out of memory\?\)$",
            ),
        ]


# -- every gradient, float64, against the loop of pure cells ------------------------------


def check_against_reference(args, grads_for=("outputs", "h_n", "c_n"), tol=None, generator=None):
    tol = tol or {}
    args = [t.detach().clone().requires_grad_() for t in args]
    ref_args = [t.detach().clone().requires_grad_() for t in args]
    out = flat(lltm_sequence(*args))
    ref = flat(reference(*ref_args))
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, **tol)
    names = ("outputs", "h_n", "c_n")
    pairs = [
        (o, r, torch.randn(r.shape, dtype=r.dtype, generator=generator).to(r.device))
        for name, o, r in zip(names, out, ref)
        if name in grads_for
    ]
    got = torch.autograd.grad([p[0] for p in pairs], args, [p[2] for p in pairs], allow_unused=True)
    want = torch.autograd.grad([p[1] for p in pairs], ref_args, [p[2] for p in pairs], allow_unused=True)
    for name, g, w, a in zip(("input", "weights", "bias", "old_h", "old_cell"), got, want, args):
        w = torch.zeros_like(a) if w is None else w
        g = torch.zeros_like(a) if g is None else g
        torch.testing.assert_close(g, w, msg=lambda m: f"grad of {name}: {m}", **tol)


SIZES = [(1, 1, 1, 1), (2, 3, 4, 5), (7, 4, 3, 6), (5, 2, 0, 4), (9, 1, 2, 3), (4, 5, 6, 33)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", SIZES, ids=str)
def test_every_gradient_float64(device, size):
    device = need(device)
    gen = torch.Generator().manual_seed(sum(size))
    args = make_args(*size, dtype=torch.float64, device=device, generator=gen)
    check_against_reference(args, generator=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grads_for", [("outputs",), ("h_n",), ("c_n",), ("h_n", "c_n"), ("outputs", "c_n")], ids=str)
def test_gradients_through_each_output(device, grads_for):
    """Only some of outputs, h_n, c_n used: the others' gradients are absent."""
    device = need(device)
    gen = torch.Generator().manual_seed(len(grads_for))
    check_against_reference(
        make_args(5, 3, 4, 6, dtype=torch.float64, device=device, generator=gen), grads_for=grads_for, generator=gen
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 100])
def test_backward_in_chunks(device, chunks):
    """The backward holds dG for ceil(T / chunks) steps at a time: any chunk
    count gives the same gradients."""
    device = need(device)
    gen = torch.Generator().manual_seed(chunks)
    with env(LLTM_OP_SEQUENCE_CHUNKS=chunks):
        check_against_reference(make_args(7, 3, 4, 5, dtype=torch.float64, device=device, generator=gen), generator=gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T, B, F, S", [(0, 3, 4, 5), (4, 0, 3, 5), (3, 2, 4, 0)])
def test_empty_sequences_have_gradients(device, T, B, F, S):
    """T = 0: the final state is the initial one (a copy), its gradient goes
    straight to old_h / old_cell and the weights get zeros; B = 0, S = 0:
    empty results and zero gradients."""
    device = need(device)
    args = [t.requires_grad_() for t in make_args(T, B, F, S, dtype=torch.float64, device=device)]
    outputs, (h_n, c_n) = lltm_sequence(*args)
    assert outputs.shape == (T, B, S) and h_n.shape == c_n.shape == (B, S)
    if T == 0:
        torch.testing.assert_close(h_n, args[3])
        torch.testing.assert_close(c_n, args[4])
        assert h_n.data_ptr() != args[3].data_ptr() or h_n.numel() == 0
    gh, gc = torch.randn_like(h_n), torch.randn_like(c_n)
    grads = torch.autograd.grad((outputs.sum() + (h_n * gh).sum() + (c_n * gc).sum()), args)
    for g, a in zip(grads, args):
        assert g.shape == a.shape
    if T == 0:
        torch.testing.assert_close(grads[3], gh)
        torch.testing.assert_close(grads[4], gc)
        assert grads[1].abs().sum() == 0 and grads[2].abs().sum() == 0
    if B == 0 or S == 0:
        assert all(g.abs().sum() == 0 for g in grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_norm_error_against_float64(device, dtype):
    """||out - ref|| / ||ref|| of every output and gradient against the loop
    of pure cells in float64 on the same (rounded) values, over 24 steps."""
    device = need(device)
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("float16 matrix products on the CPU are slow; covered on CUDA")
    limit = LIMITS[dtype]
    gen = torch.Generator().manual_seed(3)
    args = [t.requires_grad_() for t in make_args(24, 8, 16, 32, dtype=dtype, device=device, generator=gen)]
    ref_args = [t.detach().double().requires_grad_() for t in args]
    out = flat(lltm_sequence(*args))
    ref = flat(reference(*ref_args))
    grads = [torch.randn(r.shape, dtype=torch.float64, generator=gen).to(device) for r in ref]
    torch.autograd.backward(out, [g.to(dtype) for g in grads])
    torch.autograd.backward(ref, grads)
    for name, o, r in zip(("outputs", "h_n", "c_n"), out, ref):
        assert o.dtype == dtype
        assert rel_err(o, r) <= limit, name
    for name, a, r in zip(("input", "weights", "bias", "old_h", "old_cell"), args, ref_args):
        assert a.grad.dtype == dtype
        assert rel_err(a.grad, r.grad) <= limit, f"grad of {name}"


@pytest.mark.parametrize("device", DEVICES)
def test_long_sequence_float32(device):
    device = need(device)
    gen = torch.Generator().manual_seed(5)
    args = make_args(200, 4, 3, 8, dtype=torch.float32, device=device, generator=gen)
    args = [t.requires_grad_() for t in args]
    out = flat(lltm_sequence(*args))
    ref_args = [t.detach().double().requires_grad_() for t in args]
    ref = flat(reference(*ref_args))
    sum(o.sum() for o in out).backward()
    sum(r.sum() for r in ref).backward()
    for o, r in zip(out, ref):
        assert rel_err(o, r) < 1e-5
    for a, r in zip(args, ref_args):
        assert rel_err(a.grad, r.grad) < 1e-5


# -- one autograd node, what it saves, what it refuses -------------------------------------


def test_one_autograd_node_for_the_whole_sequence():
    args = [t.requires_grad_() for t in make_args(6, 2, 3, 4)]
    outputs, (h_n, c_n) = lltm_sequence(*args)
    node = outputs.grad_fn
    assert h_n.grad_fn is node and c_n.grad_fn is node
    # its inputs are the five leaves directly
    nexts = [n for n, _ in node.next_functions if n is not None]
    assert len(nexts) == 5 and all(type(n).__name__ == "AccumulateGrad" for n in nexts)


def test_saves_only_what_the_backward_needs():
    """input, weights, old_h, old_cell (the caller's tensors), the outputs,
    and the pre-activations [T, B, 3S] and cell states [T, B, S]; nothing
    per step."""
    T, B, F, S = 5, 3, 4, 6
    args = [t.requires_grad_() for t in make_args(T, B, F, S)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outputs, _ = lltm_sequence(*args)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted([(T, B, F), (3 * S, S + F), (B, S), (B, S), (T, B, S), (T, B, 3 * S), (T, B, S)]), shapes
    for arg in (args[0], args[1]):
        assert any(t.data_ptr() == arg.data_ptr() for t in saved)
    # old_h and old_cell as copies (the caller may reuse their buffers).
    for arg in (args[3], args[4]):
        assert not any(t.data_ptr() == arg.data_ptr() for t in saved)
        assert any(t.shape == arg.shape and torch.equal(t, arg) for t in saved)
    assert any(t.data_ptr() == outputs.data_ptr() for t in saved)


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_is_refused(device):
    device = need(device)
    args = [t.requires_grad_() for t in make_args(3, 2, 3, 4, dtype=torch.float64, device=device)]
    outputs, (h_n, c_n) = lltm_sequence(*args)
    # First-order gradients with create_graph=True are right (torch.func's
    # grad and vjp build them so); differentiating them is refused.
    grads = torch.autograd.grad(outputs.sum() + h_n.sum(), args, create_graph=True)
    ref_args = [t.detach().clone().requires_grad_() for t in args]
    ref_out, (ref_h, _) = reference(*ref_args)
    for g, w in zip(grads, torch.autograd.grad(ref_out.sum() + ref_h.sum(), ref_args)):
        torch.testing.assert_close(g, w)
    penalty = sum(g.square().sum() for g in grads)
    with pytest.raises(RuntimeError, match=rf"{OP}: double backward is not supported"):
        torch.autograd.grad(penalty, args)
    with pytest.raises(RuntimeError, match=rf"{OP}: double backward is not supported"):
        torch.autograd.gradgradcheck(lambda *a: flat(lltm_sequence(*a)), args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [(3, 2, 3, 4), (0, 2, 3, 4), (5, 1, 0, 3)], ids=str)
def test_forward_ad_through_the_function_and_the_registered_op(device, size):
    """Dual tensors and torch.func.jvp through lltm_sequence and through the
    registered op itself (what an exported program calls): the tangent of
    the loop of pure cells, every argument's tangent at once."""
    device = need(device)
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(sum(size))
    args = make_args(*size, dtype=torch.float64, device=device, generator=gen)
    tangents = [torch.randn(a.shape, dtype=a.dtype, generator=gen).to(device) for a in args]
    _, want = torch.func.jvp(lambda *a: reference64(*a), tuple(args), tuple(tangents))

    def through_op(*a):
        return seq_forward(*a)[:3]

    for fn in (lambda *a: flat(lltm_sequence(*a)), through_op):
        _, got = torch.func.jvp(fn, tuple(args), tuple(tangents))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        with fwAD.dual_level():
            duals = [fwAD.make_dual(a, t) for a, t in zip(args, tangents)]
            got = [fwAD.unpack_dual(o).tangent for o in fn(*duals)]
        for g, w in zip(got, want):
            assert g is not None
            torch.testing.assert_close(g, w)
    # One argument's tangent alone (the others' are zero).
    _, got = torch.func.jvp(lambda w: through_op(args[0], w, *args[2:]), (args[1],), (tangents[1],))
    _, want = torch.func.jvp(lambda w: reference64(args[0], w, *args[2:]), (args[1],), (tangents[1],))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_over_reverse_is_refused(device):
    """A tangent of the gradients (forward over reverse) is a second
    derivative: refused with the op's name, never a silent zero."""
    device = need(device)
    import torch.autograd.forward_ad as fwAD

    args = [t.requires_grad_() for t in make_args(3, 2, 3, 4, dtype=torch.float64, device=device)]
    with fwAD.dual_level():
        x = fwAD.make_dual(args[0].detach(), torch.randn_like(args[0])).requires_grad_()
        outputs, _ = lltm_sequence(x, *args[1:])
        with pytest.raises(RuntimeError, match=rf"{OP}: second derivatives are not supported"):
            torch.autograd.grad(outputs.sum(), args[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths", [None, [4, 2, 0]], ids=["whole", "packed"])
def test_sequence_backward_op_is_differentiable(device, lengths):
    """A direct call of lltm_op::sequence_backward on tensors that require
    grad (a packed run's too): the kernel's values, and derivatives with
    respect to every tensor argument (torch-op math of the same
    computation; gradcheck)."""
    device = need(device)
    gen = torch.Generator().manual_seed(11)
    args = make_args(4, 3, 2, 5, dtype=torch.float64, device=device, generator=gen)
    bs = None if lengths is None else batch_sizes_of(lengths, 4)
    outputs, h_n, c_n, gates, cells = seq_forward(*args, False, bs)
    x, w, _, h, c = args
    gs = [torch.randn(t.shape, dtype=t.dtype, generator=gen).to(device) for t in (outputs, h_n, c_n)]
    tensors = (*gs, x, w, h, c, outputs, gates, cells)
    kernel = seq_backward(*tensors, True, False, bs)
    diff = [t.clone().requires_grad_() for t in tensors]
    got = seq_backward(*diff, True, False, bs)
    for g, k in zip(got, kernel):
        assert g.grad_fn is not None
        torch.testing.assert_close(g.detach(), k)
    assert torch.autograd.gradcheck(lambda *t: seq_backward(*t, True, False, bs), diff, eps=1e-6, atol=1e-5)
    no_input = seq_backward(*diff, False, False, bs)
    assert no_input[0].shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_over_an_empty_batch(device):
    device = need(device)
    T, B, F, S = 3, 2, 4, 5
    args = [t.unsqueeze(0)[:0] for t in make_args(T, B, F, S, device=device)]
    outputs, (h_n, c_n) = torch.func.vmap(lltm_sequence)(*args)
    assert outputs.shape == (0, T, B, S) and h_n.shape == c_n.shape == (0, B, S)
    assert outputs.device.type == device
    grads = torch.func.vmap(torch.func.grad(lambda *a: lltm_sequence(*a)[0].sum()))(*args)
    assert grads.shape == (0, T, B, F)


@pytest.mark.parametrize("device", DEVICES)
def test_exported_program_under_torch_func(device):
    """An exported LLTMSequence calls the registered op; torch.func's grad,
    jacrev, jvp and jacfwd of it give the loop of pure cells' derivatives."""
    device = need(device)
    torch.manual_seed(0)
    m = LLTMSequence(3, 4).to(device=device, dtype=torch.float64)

    class Run(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = m

        def forward(self, x, h, c):
            outputs, (h_n, c_n) = self.seq(x, (h[None], c[None]))  # nn.LSTM's [layers, B, S] state
            return outputs, h_n[0], c_n[0]

    x, _, _, h, c = make_args(3, 2, 3, 4, dtype=torch.float64, device=device)
    ep = torch.export.export(Run(), (x, h, c), strict=False)
    assert seq_forward in [n.target for n in ep.graph.nodes if n.op == "call_function"]
    run = ep.module()
    w, b = m.weights.detach(), m.bias.detach()

    def ref(x, h, c):
        return reference64(x, w, b, h, c)

    def loss(fn):
        return lambda x, h, c: sum((o.sin()).sum() for o in fn(x, h, c))

    for transform in (torch.func.grad, torch.func.jacrev, torch.func.jacfwd):
        f = loss if transform is torch.func.grad else (lambda fn: fn)
        got = transform(f(run), argnums=(0, 1, 2))(x, h, c)
        want = transform(f(ref), argnums=(0, 1, 2))(x, h, c)
        torch.testing.assert_close(got, want)
    tangents = tuple(torch.randn_like(t) for t in (x, h, c))
    torch.testing.assert_close(torch.func.jvp(run, (x, h, c), tangents), torch.func.jvp(ref, (x, h, c), tangents))


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_updates(device):
    """The final state is the caller's to overwrite (gradients stay right);
    overwriting a tensor the backward needs (the outputs, old_h) is refused
    by autograd's version check, never silently wrong."""
    device = need(device)
    args = make_args(4, 3, 2, 5, dtype=torch.float64, device=device)
    a = [t.clone().requires_grad_() for t in args]
    r = [t.clone().requires_grad_() for t in args]
    outputs, (h_n, c_n) = lltm_sequence(*a)
    ref_out, (ref_h, ref_c) = reference(*r)
    for h, c in ((h_n, c_n), (ref_h, ref_c)):
        h.mul_(2)
        c.add_(1)
    (outputs.sum() + h_n.pow(2).sum() + c_n.pow(2).sum()).backward()
    (ref_out.sum() + ref_h.pow(2).sum() + ref_c.pow(2).sum()).backward()
    for x, y in zip(a, r):
        torch.testing.assert_close(x.grad, y.grad)

    a = [t.clone().requires_grad_() for t in args]
    outputs, (h_n, _) = lltm_sequence(*a)
    outputs.add_(1)
    with pytest.raises(RuntimeError, match=rf"{OP}: its result 'outputs' .*modified by an inplace operation"):
        h_n.sum().backward()
    # The initial state's buffers may take the next state (a stateful loop
    # writing h_n, c_n into the h, c it passed), as with a loop of cells.
    x, w, b, h, c = (t.clone() for t in args)
    w.requires_grad_()
    outputs, (h_n, c_n) = lltm_sequence(x, w, b, h, c)
    w_ref = w.detach().clone().requires_grad_()
    ref_out, _ = reference(x, w_ref, b, h.clone(), c.clone())
    h.copy_(h_n)
    c.copy_(c_n)
    outputs.sum().backward()
    ref_out.sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    # Overwriting what the backward needs is refused, naming what it was.
    a = [t.clone().requires_grad_() for t in args]
    x = a[0].detach().clone()
    outputs, _ = lltm_sequence(x, *a[1:])
    x.mul_(2)
    with pytest.raises(RuntimeError, match=rf"{OP}: argument 'input' was modified in place.*inplace operation"):
        outputs.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_without_grad(device):
    """Typical training: data and initial state need no gradient; no
    gradient of the input is computed (input_grad=False)."""
    device = need(device)
    x, w, b, h, c = make_args(5, 3, 4, 6, dtype=torch.float64, device=device)
    w.requires_grad_()
    b.requires_grad_()
    outputs, (h_n, c_n) = lltm_sequence(x, w, b, h, c)
    (outputs.sum() + c_n.pow(2).sum()).backward()
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ro, (rh, rc) = reference(x, w2, b2, h, c)
    (ro.sum() + rc.pow(2).sum()).backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(b.grad, b2.grad)
    with torch.no_grad():
        out = lltm_sequence(x, w, b, h, c)
    assert not out[0].requires_grad
    torch.testing.assert_close(out[0], ro.detach())
    with torch.inference_mode():
        out = lltm_sequence(x, w, b, h, c)
    torch.testing.assert_close(out[1][0], rh.detach())


# -- autocast, compile, export ----------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_like_the_pure_cell(device):
    """Under autocast (bfloat16), float32 arguments run in bfloat16 and come
    back in float32, as from the loop of pure cells under autocast; mixed
    bfloat16 input / float32 weights run too."""
    device = need(device)
    gen = torch.Generator().manual_seed(7)
    args = [t.requires_grad_() for t in make_args(6, 4, 8, 16, device=device, generator=gen)]
    x_bf16 = args[0].detach().bfloat16().requires_grad_()
    ref_args = [t.detach().double().requires_grad_() for t in args]
    with torch.autocast(device, dtype=torch.bfloat16):
        outputs, (h_n, c_n) = lltm_sequence(*args)
        mixed, _ = lltm_sequence(x_bf16, *(t.detach() for t in args[1:]))
        pure, (pure_h, pure_c) = reference(*args)
    assert outputs.dtype == h_n.dtype == c_n.dtype == pure.dtype == pure_c.dtype == torch.float32
    assert mixed.dtype == torch.float32
    (outputs.sum() + h_n.square().sum() + c_n.square().sum()).backward()
    mixed.sum().backward()
    ref, (ref_h, ref_c) = reference(*ref_args)
    (ref.sum() + ref_h.square().sum() + ref_c.square().sum()).backward()
    for o, r in ((outputs, ref), (h_n, ref_h), (c_n, ref_c), (mixed, ref)):
        assert rel_err(o, r) < 3e-2
    for a, r in zip(args, ref_args):
        assert a.grad.dtype == torch.float32
        assert rel_err(a.grad, r.grad) < 5e-2
    assert x_bf16.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [50, 500])
def test_autocast_keeps_the_state_precision_of_the_loop_of_cells(device, T):
    """Under autocast (bfloat16) with a float32 state, the final state's
    error against float64 is that of T calls of lltm_op.lltm under the same
    autocast (the state stays float32), not that of a bfloat16 state (the
    LLTM has no forget gate: its state grows and bfloat16 swamps it; 13x
    the loop's error at T=50, 120x at T=500, before this held)."""
    device = need(device)
    low = torch.bfloat16
    B, F, S = 4, 8, 16
    gen = torch.Generator().manual_seed(T)
    args = make_args(T, B, F, S, device=device, generator=gen)
    _, (h64, c64) = reference(*(t.double() for t in args))
    with torch.autocast(device, dtype=low):
        _, (h_n, c_n) = lltm_sequence(*args)
        h, c = args[3], args[4]
        for t in range(T):
            h, c = lltm(args[0][t], args[1], args[2], h, c)
    assert h_n.dtype == c_n.dtype == c.dtype == torch.float32
    assert rel_err(c_n, c64) <= 2 * rel_err(c, c64), (rel_err(c_n, c64), rel_err(c, c64))
    assert rel_err(h_n, h64) <= 2 * rel_err(h, h64), (rel_err(h_n, h64), rel_err(h, h64))


@pytest.mark.parametrize("device", DEVICES)
def test_module_compiles_fullgraph_with_backward(device):
    device = need(device)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = LLTMSequence(6, 10).to(device)
    x = torch.randn(5, 3, 6, device=device)
    h, c = torch.randn(3, 10, device=device), torch.randn(3, 10, device=device)

    def loss_of(x, h, c):
        outputs, (h_n, c_n) = m(x, (h[None], c[None]))  # nn.LSTM's [layers, B, S] state
        return outputs.square().sum() + h_n.sum() + c_n.square().sum()

    compiled = torch.compile(loss_of, fullgraph=True)
    loss = compiled(x, h, c)
    loss.backward()
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    want = loss_of(x, h, c)
    want.backward()
    torch.testing.assert_close(loss, want)
    for g, p in zip(got, m.parameters()):
        torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("strict", [True, False])
def test_export_keeps_the_custom_op(strict):
    m = LLTMSequence(5, 8)

    class Run(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = m

        def forward(self, x, h, c):
            outputs, (h_n, c_n) = self.seq(x, (h[None], c[None]))  # nn.LSTM's [layers, B, S] state
            return outputs, h_n[0], c_n[0]

    x, h, c = torch.randn(4, 3, 5), torch.randn(3, 8), torch.randn(3, 8)
    ep = torch.export.export(Run(), (x, h, c), strict=strict)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert seq_forward in targets
    for got, want in zip(ep.module()(x, h, c), flat(reference(x, m.weights, m.bias, h, c))):
        torch.testing.assert_close(got, want)


# -- the module ------------------------------------------------------------------------------


def test_a_trained_cell_drops_in():
    """LLTMSequence.from_cell and a cell's state_dict give the same results
    (and gradients) as the cell run step by step with lltm_op.lltm."""
    torch.manual_seed(0)
    cell = LLTM(7, 12)
    with torch.no_grad():
        for p in cell.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # "trained"
    seq = LLTMSequence.from_cell(cell)
    assert seq.weights is cell.weights and seq.bias is cell.bias
    loaded = LLTMSequence(7, 12)
    loaded.load_state_dict(cell.state_dict())
    x = torch.randn(9, 4, 7)
    h0, c0 = torch.randn(4, 12), torch.randn(4, 12)
    h, c, outs = h0, c0, []
    for t in range(9):
        h, c = cell(x[t], (h, c))
        outs.append(h)
    loop = torch.stack(outs)
    (loop.sum() + c.sum()).backward()
    want = [p.grad.clone() for p in cell.parameters()]
    cell.zero_grad()
    for m in (seq, loaded):
        outputs, (h_n, c_n) = m(x, (h0[None], c0[None]))
        h_n, c_n = h_n[0], c_n[0]
        torch.testing.assert_close(outputs, loop)
        torch.testing.assert_close(h_n, h)
        torch.testing.assert_close(c_n, c)
    outputs, (_, c_n) = seq(x, (h0[None], c0[None]))
    (outputs.sum() + c_n.sum()).backward()
    for g, p in zip(want, cell.parameters()):
        torch.testing.assert_close(p.grad, g)
    zero_state, _ = seq(x)
    torch.testing.assert_close(zero_state, flat(reference(x, cell.weights, cell.bias, 0 * h0, 0 * c0))[0])
    assert repr(loaded) == "LLTMSequence(7, 12)"


@pytest.mark.parametrize("device", DEVICES)
def test_short_training_loop_loss_falls(device):
    device = need(device)
    torch.manual_seed(0)
    T, B, F, S = 6, 32, 8, 16
    seq = LLTMSequence(F, S).to(device)
    head = torch.nn.Linear(S, 1).to(device)
    opt = torch.optim.Adam([*seq.parameters(), *head.parameters()], lr=1e-2)
    xs = torch.randn(T, B, F, device=device)
    target = torch.randn(B, 1, device=device).clamp(-1.5, 1.5)
    losses = []
    for _ in range(120):
        _, (h_n, _) = seq(xs)
        loss = torch.nn.functional.mse_loss(head(h_n[0]), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])


# -- CUDA: every step path, graphs, memory ----------------------------------------------------

# The CUDA step paths, forced: cuBLAS products and a cell kernel per step,
# fused step kernels launched one per step, and the persistent fused kernels
# (one launch for the forward, one per backward chunk; the default where the
# fused path runs and the grid fits the GPU).
PATHS = {
    # The forward's step products on tensor cores through cuBLASLt (float16,
    # bfloat16, float32 on TF32; the others through aten::mm), or all
    # through aten::mm.
    "cublas": {"LLTM_OP_SEQUENCE_FUSED": "0"},
    "cublas_aten": {"LLTM_OP_SEQUENCE_FUSED": "0", "LLTM_OP_SEQUENCE_CUBLASLT": "0"},
    "fused": {"LLTM_OP_SEQUENCE_FUSED": "1", "LLTM_OP_SEQUENCE_PERSISTENT": "0"},
    "persistent": {
        "LLTM_OP_SEQUENCE_FUSED": "1",
        "LLTM_OP_SEQUENCE_PERSISTENT": "1",
        "LLTM_OP_SEQUENCE_TENSOR_CORES": "0",
        "LLTM_OP_SEQUENCE_RESIDENT": "0",
    },
    # float32 with S a multiple of 4: the resident-weight FMA kernels (the
    # default there without TF32); other dtypes and sizes take the default
    # path.
    "resident": {"LLTM_OP_SEQUENCE_RESIDENT": "1", "LLTM_OP_SEQUENCE_TENSOR_CORES": "0"},
    # float16 / bfloat16 with S a multiple of 8 on sm_80+: the tensor-core
    # persistent kernels (the block-local ones where runs_block_local says);
    # other dtypes and sizes take the default path.
    "tensor_cores": {"LLTM_OP_SEQUENCE_TENSOR_CORES": "1"},
    # The global-barrier tensor-core kernels at every size.
    "tc_global": {"LLTM_OP_SEQUENCE_TENSOR_CORES": "1", "LLTM_OP_SEQUENCE_LOCAL": "0"},
    # The block-local ones in clusters of 4 blocks wherever those fit (sm_90).
    "tc_local_clusters": {"LLTM_OP_SEQUENCE_TENSOR_CORES": "1", "LLTM_OP_SEQUENCE_LOCAL_CLUSTER": "4"},
    # Those with the forward's cluster variant (opt-in) where its clusters
    # fit (sm_90).
    "tc_clusters": {
        "LLTM_OP_SEQUENCE_TENSOR_CORES": "1",
        "LLTM_OP_SEQUENCE_LOCAL": "0",
        "LLTM_OP_SEQUENCE_CLUSTERS": "1",
    },
}

# A tensor-core kernel's name: the global-barrier or a block-local one (the
# backward's by partial sums too).
_TC_KERNEL = {d: re.compile(rf"{d}_tc(_local|_partial)?_kernel<") for d in ("forward", "backward")}


def count_tc(names: list[str], direction: str, local: bool | None = None) -> int:
    """Launches of the tensor-core kernels of `direction` ("forward",
    "backward") in `names`; only the block-local (local=True) or only the
    global-barrier ones (local=False) where asked."""
    found = [_TC_KERNEL[direction].search(n) for n in names]
    return sum(1 for m in found if m and (local is None or bool(m.group(1)) == local))


def runs_block_local(S: int, dtype: torch.dtype, direction: str) -> bool:
    """Whether the tensor-core path runs `direction` block-locally at state
    size S on this GPU (the rule of compute_local_launch, for grids that
    fit): one block up to S = 64 (96 in 16-bit types without clusters),
    one block or clusters on sm_90 up to S = 512 forward / 256 backward in
    16-bit types and 256 / 128 in float32."""
    half = dtype != torch.float32
    if torch.cuda.get_device_capability()[0] < 9:
        return S <= (96 if half else 64)
    limits = {"forward": 512 if half else 256, "backward": 256 if half else 128}
    return S <= limits[direction]


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "size", [(5, 3, 4, 6), (3, 7, 5, 33), (4, 70, 9, 40), (2, 5, 3, 130), (3, 1, 2, 1), (9, 16, 8, 64)], ids=str
)
def test_cuda_paths_match_the_reference(path, dtype, size):
    """Every CUDA step path, forced, on sizes off every block width (S = 33,
    130; B = 70 past 64 rows) and over several chunks, against float64."""
    need("cuda")
    gen = torch.Generator().manual_seed(sum(size))
    limit = LIMITS[dtype]
    with env(**PATHS[path], LLTM_OP_SEQUENCE_CHUNKS=2):
        args = [t.requires_grad_() for t in make_args(*size, dtype=dtype, device="cuda", generator=gen)]
        ref_args = [t.detach().double().cpu().requires_grad_() for t in args]
        out = flat(lltm_sequence(*args))
        ref = flat(reference(*ref_args))
        grads = [torch.randn(r.shape, dtype=torch.float64, generator=gen) for r in ref]
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])
        torch.autograd.backward(ref, grads)
    for name, o, r in zip(("outputs", "h_n", "c_n"), out, ref):
        assert rel_err(o.cpu(), r) <= limit, name
    for name, a, r in zip(("input", "weights", "bias", "old_h", "old_cell"), args, ref_args):
        assert rel_err(a.grad.cpu(), r.grad) <= limit, f"grad of {name}"


def _profiled_events(fn, cpu: bool = False):
    """torch.profiler's events of fn (CUDA; the CPU's operator calls too
    where asked)."""
    acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if cpu else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        torch.cuda.synchronize()
    return prof.events()


def _kernel_names(events) -> list[str]:
    return [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]


def _cuda_kernel_names(fn) -> list[str]:
    return _kernel_names(_profiled_events(fn))


@contextlib.contextmanager
def tf32_matmul(allowed: bool):
    """torch's float32 matmul setting (TF32 tensor cores or not), restored."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "size",
    [
        (5, 3, 4, 8),
        (1, 5, 3, 16),
        (3, 70, 9, 40),
        (4, 16, 8, 64),
        (4, 20, 6, 96),
        (2, 33, 16, 136),
        (6, 130, 24, 256),
        (3, 300, 32, 128),
    ],
    ids=str,
)
def test_cuda_tensor_core_kernels_run_and_match_the_reference(dtype, size):
    """The tensor-core persistent kernels (sm_80+; float32 on TF32 tensor
    cores, with torch's TF32 setting on): they run (one launch for the
    forward, one per backward chunk; the block-local ones where
    runs_block_local says, the global-barrier ones past it) and
    match float64 on sizes off every tile: B below one 16-row tile and past
    it (3, 70, 300: several batch blocks), S = 8 and 40 (a half-filled k
    tile), T = 1, several chunks."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernels need sm_80 or newer")
    T, B, F, S = size
    gen = torch.Generator().manual_seed(sum(size))
    # float32 on TF32: products of operands rounded to 10-bit mantissas.
    limit = TF32_LIMIT if dtype == torch.float32 else LIMITS[dtype]
    chunks = min(2, T)
    with env(LLTM_OP_SEQUENCE_TENSOR_CORES="1", LLTM_OP_SEQUENCE_CHUNKS=chunks), tf32_matmul(True):
        args = [t.requires_grad_() for t in make_args(*size, dtype=dtype, device="cuda", generator=gen)]
        ref_args = [t.detach().double().cpu().requires_grad_() for t in args]
        ref = flat(reference(*ref_args))
        grads = [torch.randn(r.shape, dtype=torch.float64, generator=gen) for r in ref]
        out = []

        def run():
            out.extend(flat(lltm_sequence(*args)))
            torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

        names = _cuda_kernel_names(run)
        torch.autograd.backward(ref, grads)
    assert count_tc(names, "forward", runs_block_local(S, dtype, "forward")) == 1, names
    assert count_tc(names, "backward", runs_block_local(S, dtype, "backward")) == chunks, names
    assert not any("fused_kernel" in n or "persistent_kernel" in n for n in names), names
    for name, o, r in zip(("outputs", "h_n", "c_n"), out, ref):
        assert rel_err(o.cpu(), r) <= limit, name
    for name, a, r in zip(("input", "weights", "bias", "old_h", "old_cell"), args, ref_args):
        assert rel_err(a.grad.cpu(), r.grad) <= limit, f"grad of {name}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "C,S",
    [(1, 64), (2, 40), (2, 128), (4, 96), (4, 128), (8, 40), (8, 256), (16, 128), (16, 200), (16, 512)],
    ids=str,
)
@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
@pytest.mark.parametrize("split", [1, 2], ids=["one_warp_a_tile", "two_warps_a_tile"])
@pytest.mark.parametrize("rows", [16, 8], ids=["rows16", "rows8"])
def test_cuda_block_local_clusters_match_the_reference(dtype, C, S, packed, split, rows):
    """The block-local kernels with their columns over a cluster of C blocks
    (LLTM_OP_SEQUENCE_LOCAL_CLUSTER=C, sm_90), each block its share of the
    column tiles (some none: S = 40 over 8 blocks, 200 over 16) and the
    state pushed to the others' shared memory every step (st.async, each
    block waiting on its own mbarrier): both directions run block-locally
    and match float64, with packed rows (lengths of 0, rows ending inside a
    tile), B = 37 (a part-filled block), two backward chunks. S = 512 over
    16 blocks is the rule's 16-bit forward there. Past 8 chunks of k
    (16-bit S > 256, float32 S > 128) with at most 4 tiles a block, the
    forward runs on two warps a tile (each half of k) unless
    LLTM_OP_SEQUENCE_LOCAL_SPLIT=1: both are checked, and which ran. Each
    with 16 batch rows a cluster and with 8 (LLTM_OP_SEQUENCE_LOCAL_ROWS;
    the rule's where they fit), B = 37 then five clusters."""
    need("cuda")
    if C > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90 or newer")
    if C == 1 and rows == 8:
        pytest.skip("8 rows a cluster are the clusters' variant")
    if dtype == torch.float32 and S > 256:
        pytest.skip("float32 at S = 512 does not fit 16 blocks' shared memory")
    tiles_a_block = ((S + 7) // 8 + C - 1) // C
    splits = C > 1 and S > (128 if dtype == torch.float32 else 256) and 2 * tiles_a_block <= 8
    if split == 1 and not splits:
        pytest.skip("one variant here: the forward's split does not apply")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernels need sm_80 or newer")
    T, B, F = 5, 37, 6
    gen = torch.Generator().manual_seed(C * S + packed)
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    bs = batch_sizes_of(lengths, T) if packed else None
    out = []

    def run():
        out.extend(run_op(*args, bs)[:3])
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

    with (
        env(
            LLTM_OP_SEQUENCE_TENSOR_CORES="1",
            LLTM_OP_SEQUENCE_LOCAL_CLUSTER=C,
            LLTM_OP_SEQUENCE_LOCAL_SPLIT=split,
            LLTM_OP_SEQUENCE_LOCAL_ROWS=rows,
            LLTM_OP_SEQUENCE_CHUNKS=2,
        ),
        tf32_matmul(True),
    ):
        names = _cuda_kernel_names(run)
    assert count_tc(names, "forward", True) == 1, names
    assert count_tc(names, "backward", True) == 2, names
    local = _tc_kernel_args(names, "tc_local")
    forward = [a for kind, a in local if kind == "forward"]
    # kSplit: the forward's last template argument; kRows: the forward's
    # sixth, the backward's last (the backward by partial sums has 8).
    backward = [a[5] for kind, a in local if kind == "backward"]
    partial = _tc_kernel_args(names, "tc_partial")
    backward += ["8"] * len(partial)
    assert [a[6] == "2" for a in forward] == [splits and split == 2], forward
    assert [a[5] for a in forward] == [str(rows)], forward
    assert backward == [str(rows)] * 2, backward
    warps_a_block = tiles_a_block if C > 1 else 0
    wide = dtype != torch.float32
    assert len(partial) == 2 * partial_backward_built(S, C, warps_a_block, False, rows, packed, wide), names
    limit = TF32_LIMIT if dtype == torch.float32 else LIMITS[dtype]
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["bf16", "f16", "tf32", "full"])
@pytest.mark.parametrize("S,packed", [(100, False), (37, True), (6, False), (130, True)], ids=str)
@pytest.mark.parametrize("pad", ["1", "0"], ids=["padded", "unpadded"])
def test_cuda_state_sizes_off_eight_run_padded(precision, S, packed, pad):
    """A state size that is not a multiple of 8 runs the tensor-core kernels
    (full float32: the block-local FMA kernels, up to 128 on sm_90, 32
    below) at the next multiple of 8, the padded columns zero: those kernels
    ran (LLTM_OP_SEQUENCE_PAD=0: none did), and the outputs, final state and
    every argument's gradient match float64 within the dtype's error, with
    packed rows (lengths of 0, rows ending inside a chunk), B = 5 and 11
    (not a multiple of 8), two backward chunks."""
    need("cuda")
    major = torch.cuda.get_device_capability()[0]
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(precision, torch.float32)
    Sp = (S + 7) // 8 * 8
    if precision == "full":
        kernels = major >= 8 and Sp <= (128 if major >= 9 else 32)
        family = re.compile(r"(forward|backward)_fma_(local|partial)_kernel<")
    else:
        kernels = major >= 8
        family = re.compile(r"(forward|backward)_tc(_local|_partial|_ksplit)?_kernel<")
    T, B, F = 6, 11 if packed else 5, 7
    gen = torch.Generator().manual_seed(S * 3 + packed)
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    bs = batch_sizes_of(lengths, T) if packed else None
    out = []

    def run():
        out.extend(run_op(*args, bs)[:3])
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

    with env(LLTM_OP_SEQUENCE_PAD=pad, LLTM_OP_SEQUENCE_CHUNKS=2), tf32_matmul(precision == "tf32"):
        names = _cuda_kernel_names(run)
    ran = [n for n in names if family.search(n)]
    assert bool(ran) == (kernels and pad == "1"), names
    limit = TF32_LIMIT if precision == "tf32" else LIMITS[dtype]
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)


def _run_by_the_rule(dtype, B, S) -> list[str]:
    """One forward+backward (T5, F6, whole batch, two backward chunks) on the
    tensor-core kernels by the rule's plan (float32 on TF32), checked
    against float64 within the dtype's error: the kernels' names (sm_90,
    else the test skips)."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("8 rows a cluster are the clusters' variant (sm_90)")
    T, F = 5, 6
    gen = torch.Generator().manual_seed(B * S)
    lengths = [T] * B
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    out = []

    def run():
        out.extend(run_op(*args, None)[:3])
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

    with env(LLTM_OP_SEQUENCE_TENSOR_CORES="1", LLTM_OP_SEQUENCE_CHUNKS=2), tf32_matmul(True):
        names = _cuda_kernel_names(run)
    limit = TF32_LIMIT if dtype == torch.float32 else LIMITS[dtype]
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)
    return names


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B", [13, 32, 40], ids=str)
@pytest.mark.parametrize("S", [264, 512], ids=str)
def test_cuda_wide_16bit_forward_takes_eight_rows_where_its_clusters_fit(dtype, B, S):
    """Past S = 256 (up to 512) the 16-bit block-local forward runs on
    clusters of 16 blocks; the rule gives them 8 batch rows where those
    clusters take at most half the multiprocessors (B <= 32 on an H100 or
    H200), else 16: the forward kernel's row count as its name says, and
    float64's result within the dtype's error (the backward runs the
    global-barrier kernels here)."""
    names = _run_by_the_rule(dtype, B, S)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    want = "8" if 2 * 16 * ((B + 7) // 8) <= sms else "16"
    forward = [a for kind, a in _tc_kernel_args(names, "tc_local") if kind == "forward"]
    assert [a[5] for a in forward] == [want], names


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("B", [3, 8], ids=str)
@pytest.mark.parametrize("S", [16, 24, 32, 40, 120, 128, 256], ids=str)
def test_cuda_small_batches_take_eight_rows_by_the_rule(dtype, B, S):
    """At B <= 8 (one cluster either way) the rule runs the block-local
    kernels on 8 batch rows a cluster in float32 (TF32) from S = 40 to 256
    (its forward from S = 24), and in 16-bit types from S = 40 to 128; on
    16 elsewhere (one block at the smallest sizes): the kernels' row count
    as their names say, and float64's result within the dtype's error, two
    backward chunks."""
    names = _run_by_the_rule(dtype, B, S)
    if dtype == torch.float32:
        want, want_forward = ("8" if 40 <= S <= 256 else "16"), ("8" if 24 <= S <= 256 else "16")
    else:
        want = want_forward = "8" if 40 <= S <= 128 else "16"
    local = _tc_kernel_args(names, "tc_local")
    forward = [a for kind, a in local if kind == "forward"]
    # kRows: the forward's sixth template argument, the backward's last
    # (the backward by partial sums has 8).
    backward = [a[5] for kind, a in local if kind == "backward"]
    backward += ["8"] * len(_tc_kernel_args(names, "tc_partial"))
    assert [a[5] for a in forward] == [want_forward], names
    assert backward == [want] * len(backward), names
    assert len(backward) == (2 if runs_block_local(S, dtype, "backward") else 0), names


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("size", [(3, 1, 4, 40), (5, 5, 6, 136), (2, 8, 3, 264)], ids=str)
@pytest.mark.parametrize("half_rows", ["1", "0"], ids=["half_rows", "both_halves"])
def test_cuda_global_kernels_half_rows_match_the_reference(dtype, size, half_rows):
    """The global-barrier tensor-core kernels at B <= 8 (one row tile, its
    second half past the batch): their kHalfRows variants, which skip that
    half's loads (the default in 16-bit types), and the ones that load it
    (LLTM_OP_SEQUENCE_HALF_ROWS=0) both run, as the kernel names say, and
    match float64; B = 1, 5 and 8, two backward chunks."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernels need sm_80 or newer")
    gen = torch.Generator().manual_seed(sum(size))
    limit = LIMITS[dtype]
    T, B = size[:2]
    lengths = [T] * B  # a whole batch: the packed case's reference and checks, every row full
    args = make_args(*size, dtype=dtype, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    out = []

    def run():
        out.extend(flat(lltm_sequence(*args)))
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

    with env(
        LLTM_OP_SEQUENCE_TENSOR_CORES="1",
        LLTM_OP_SEQUENCE_LOCAL="0",
        LLTM_OP_SEQUENCE_HALF_ROWS=half_rows,
        LLTM_OP_SEQUENCE_CHUNKS=2,
    ):
        names = _cuda_kernel_names(run)
    kernels = _tc_kernel_args(names)
    assert len(kernels) == 3, names
    # kHalfRows: the forward's fifth template argument, the backward's fourth.
    assert all(args[4 if kind == "forward" else 3] == (half_rows == "1") for kind, args in kernels), kernels
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)


def _tc_kernel_args(names, family: str = "tc") -> list[tuple[str, list]]:
    """(forward or backward, template arguments) of the kernels of `family`
    among kernel names: "tc", the global-barrier tensor-core kernels;
    "tc_local" and "fma_local", the block-local ones. The first argument as
    named (the dtype), then ints as strings and bools (as True / False,
    whether the name says true/false or 1/0)."""
    found = []
    for n in names:
        m = re.search(rf"(forward|backward)_{family}_kernel<([^>]*)>", n)
        if m:
            parts = [a.strip() for a in m.group(2).split(",")]
            parse = {"true": True, "false": False, "(bool)1": True, "(bool)0": False}
            found.append((m.group(1), [parts[0]] + [parse.get(a, a) for a in parts[1:]]))
    return found


def _global_kernels_run(inputs, lengths, bs, dtype, **settings) -> tuple[list, list, list]:
    """One forward+backward of fresh copies of `inputs` on the global-barrier
    tensor-core kernels (two backward chunks) under the environment
    `settings`: it matches float64 within the dtype's error (float32 on
    TF32); returns the kernel names, the forward kernel's template
    arguments (one list a launch) and the outputs then the five gradients."""
    args, ref_args, ref, grads = packed_case(
        [t.detach().clone() for t in inputs], lengths, torch.Generator().manual_seed(1)
    )
    out = []

    def run():
        out.extend(run_op(*args, bs)[:3])
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

    with (
        env(
            LLTM_OP_SEQUENCE_TENSOR_CORES="1",
            LLTM_OP_SEQUENCE_LOCAL="0",
            LLTM_OP_SEQUENCE_CHUNKS=2,
            **settings,
        ),
        tf32_matmul(dtype == torch.float32),
    ):
        names = _cuda_kernel_names(run)
    limit = TF32_LIMIT if dtype == torch.float32 else LIMITS[dtype]
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)
    forward = [a for kind, a in _tc_kernel_args(names) if kind == "forward"]
    return names, forward, [o.detach() for o in out] + [a.grad for a in args]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("size", [(4, 8, 6, 136), (3, 5, 6, 264), (3, 37, 5, 72), (2, 64, 3, 40)], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("shape", ["0", "1032", "2032"], ids=["plan", "q1-bm32", "q2-bm32"])
def test_cuda_global_forward_spread_cells_match_the_tiles_cells(dtype, size, packed, shape):
    """The global-barrier forward with 4 or 8 warps a row tile (16 or 32
    rows a block) runs its cells on all the block's threads (kSpread, the last template
    argument), each summing the warps' partial products in the order the
    tile's first warp did: outputs, final state and all five gradients equal
    those of LLTM_OP_SEQUENCE_SPREAD_CELLS=0 (the tile's first warp runs
    them) bit for bit, and float64's within the dtype's error (float32 on
    TF32); B = 5, 8 (half rows in 16-bit types), 37, 64, packed too; the
    plan's block shape (16 rows: 8 warps a tile) and 32 rows (4 warps a
    tile, LLTM_OP_SEQUENCE_TC_SHAPE) of 8 and 16 columns."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernels need sm_80 or newer")
    gen = torch.Generator().manual_seed(sum(size) + packed)
    T, B = size[:2]
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    bs = batch_sizes_of(lengths, T) if packed else None
    inputs = make_args(*size, dtype=dtype, device="cuda", generator=gen)
    runs = {}
    for spread in ("1", "0"):
        names, forward, runs[spread] = _global_kernels_run(
            inputs,
            lengths,
            bs,
            dtype,
            LLTM_OP_SEQUENCE_SPREAD_CELLS=spread,
            LLTM_OP_SEQUENCE_TC_SHAPE=shape,
        )
        assert len(forward) == 1 and forward[0][5] == (spread == "1"), names
    for a, b in zip(runs["1"], runs["0"]):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "size,shape",
    [
        ((3, 64, 5, 512), "1064"),
        ((2, 70, 3, 1000), "2064"),
        ((3, 128, 4, 256), "4128"),
        ((2, 200, 6, 1024), "4064"),
        ((3, 64, 5, 136), "1064"),
    ],
    ids=str,
)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cuda_global_forward_wgmma_matches_the_reference(dtype, size, shape, packed):
    """The 16-bit global-barrier forward with 4 or 8 row tiles a block (64
    or 128 rows) runs its product on the warpgroups' wgmma on an sm_90
    device (kWgmma, the kernel's seventh template argument; an sm_90a
    build has the instruction, others run mma.sync in the same kernel)
    where each warpgroup's share of k is whole groups of 8 chunks of 32
    (S = 256 at 128 rows, 512 and 1000 at 64; not S = 136), and
    LLTM_OP_SEQUENCE_WGMMA=0 turns it off: both match float64 within the
    dtype's error, outputs, final state and all five gradients. At 64 rows
    (two warpgroups, each half of k) with 2 or 4 column groups (2064,
    4064) the halves exchange their sums by column group and both run
    cells (exchange_k_halves); B = 64,
    70, 128 and 200 (part-filled row tiles and blocks), S = 1000 (a last
    chunk past the row), packed rows (a warpgroup whose rows end inside
    it), two backward chunks."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernels need sm_80 or newer")
    T, B, _, S = size
    bm = int(shape) % 1000
    shares = max(1, 8 // (bm // 16))
    chunks = (S + 31) // 32
    whole = chunks % shares == 0 and (chunks // shares) % 8 == 0
    runs_wgmma = torch.cuda.get_device_capability() == (9, 0) and whole
    gen = torch.Generator().manual_seed(sum(size) + packed)
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    bs = batch_sizes_of(lengths, T) if packed else None
    inputs = make_args(*size, dtype=dtype, device="cuda", generator=gen)
    for wgmma in ("1", "0"):
        names, forward, _ = _global_kernels_run(
            inputs, lengths, bs, dtype, LLTM_OP_SEQUENCE_WGMMA=wgmma, LLTM_OP_SEQUENCE_TC_SHAPE=shape
        )
        assert len(forward) == 1 and forward[0][6] == (runs_wgmma and wgmma == "1"), names


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "size", [(3, 128, 5, 1024), (4, 70, 3, 1024), (1, 130, 4, 1024), (3, 256, 2, 1024), (2, 64, 3, 1024)], ids=str
)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cuda_ksplit_backward_matches_the_reference(dtype, size, packed):
    """The 16-bit global-barrier backward at S = 1024 past one block row (B >
    64) on an sm_90 device, in a build with sm_90a code (wgmma), runs with k
    split over clusters of 4 blocks (backward_ksplit_kernel: each block a
    quarter of k for 128 columns, the partial sums exchanged in distributed
    shared memory) on padded batches where every cluster fits at once;
    LLTM_OP_SEQUENCE_KSPLIT=0, packed batches, B <= 64 and builds without
    sm_90a run backward_tc_kernel. Both match float64 within
    the dtype's error, outputs, final state and all five gradients: B = 70
    and 130 (part-filled row blocks), 64, 128 and 256, T = 1 (the last step
    alone: no recurrent product), two backward chunks."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the k-split backward needs thread block clusters (sm_90)")
    T, B = size[:2]
    archs = {a.split("+")[0] for a in (BUILD_INFO.get("cuda_arch_list") or "").replace(";", " ").split()}
    wgmma_built = torch.cuda.get_device_capability() == (9, 0) and "9.0a" in archs
    gen = torch.Generator().manual_seed(sum(size) + packed)
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    bs = batch_sizes_of(lengths, T) if packed else None
    inputs = make_args(*size, dtype=dtype, device="cuda", generator=gen)
    for ksplit in ("1", "0"):
        names, _, _ = _global_kernels_run(inputs, lengths, bs, dtype, LLTM_OP_SEQUENCE_KSPLIT=ksplit)
        ran = any("backward_ksplit_kernel" in n for n in names)
        assert not ran or (ksplit == "1" and not packed and B > 64 and wgmma_built), names
        # Every cluster resident at once: B <= 128 (16 clusters) on any sm_90 part.
        if ksplit == "1" and not packed and 64 < B <= 128 and wgmma_built:
            assert ran, names


# The global-barrier tensor-core kernels' block shapes, as
# LLTM_OP_SEQUENCE_TC_SHAPE writes them: 1000 q + bm (8 q columns, bm rows a
# block; bm 16 and 32 split k over the warps, 128 does not).
TC_SHAPES = [1016, 2016, 4016, 1032, 2048, 4128]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("size", [(3, 5, 6, 136), (2, 70, 3, 40), (1, 33, 4, 264)], ids=str)
@pytest.mark.parametrize("shape", TC_SHAPES, ids=str)
def test_cuda_global_kernels_in_each_block_shape_match_the_reference(dtype, size, shape):
    """The global-barrier tensor-core kernels (float32 on TF32) in each block
    shape the plan can take, forced: they run (one forward launch, one a
    backward chunk, of that q), read W_h in place and match float64: S =
    136 (a part-filled column block at q = 2 and 4), 40, 264; B = 5, 33 and
    70 (a part-filled last row block); T = 1."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernels need sm_80 or newer")
    T, B, F, S = size
    q, bm = shape // 1000, shape % 1000
    if -(-S // (8 * q)) * -(-B // bm) > torch.cuda.get_device_properties(0).multi_processor_count:
        pytest.skip("that block shape's grid may not be resident at once here")
    gen = torch.Generator().manual_seed(sum(size) + shape)
    limit = TF32_LIMIT if dtype == torch.float32 else LIMITS[dtype]
    lengths = [T] * B  # a whole batch: the packed case's reference and checks, every row full
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    chunks = min(2, T)
    out = []

    def run():
        out.extend(flat(lltm_sequence(*args)))
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

    with (
        env(LLTM_OP_SEQUENCE_LOCAL="0", LLTM_OP_SEQUENCE_TC_SHAPE=shape, LLTM_OP_SEQUENCE_CHUNKS=chunks),
        tf32_matmul(True),
    ):
        names = _cuda_kernel_names(run)
    kernels = [m.groups() for n in names if (m := re.search(r"(forward|backward)_tc_kernel<[^,]+, (\d+),", n))]
    assert sorted(kernels) == sorted([("backward", str(q))] * chunks + [("forward", str(q))]), names
    assert not any("transpose_kernel" in n for n in names), names
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)


# The resident-weight kernels' block shapes, as LLTM_OP_SEQUENCE_RESIDENT_SHAPE
# writes them: NJ * 100 + RT * 10 + row warps (NJ columns, bm = 8 RT
# row_warps rows a block).
RESIDENT_SHAPES = [411, 418, 441, 442, 811, 812, 841, 848]


@pytest.mark.cuda
@pytest.mark.parametrize(
    "size",
    [(1, 1, 3, 4), (5, 3, 4, 12), (4, 70, 9, 36), (3, 8, 5, 100), (2, 33, 6, 260), (3, 300, 4, 64)],
    ids=str,
)
@pytest.mark.parametrize("shape", [None, *RESIDENT_SHAPES], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
def test_cuda_resident_kernels_run_and_match_the_reference(size, shape, packed):
    """Full-precision float32 (no TF32) on the resident-weight kernels
    (the block-local ones turned off: they take S = 64): each block's slice
    of W_h in shared memory for every step, the product on the FMA units.
    They run (one launch for the forward, one per backward chunk, no step
    kernels) in the rule's block shape and in each forced one,
    and match float64 to float32's error: S = 4 and 12 (a part-filled k round
    and column block), 36 and 100 (k rounds split unevenly over the warps),
    260; B = 1, 3 (one block, mostly idle rows), 70 and 300 (several batch
    blocks, a part-filled last one); T = 1; packed rows (lengths of 0, rows
    ending inside a block); two backward chunks."""
    need("cuda")
    T, B, F, S = size
    if shape is not None:
        nj, rt, row_warps = shape // 100, shape // 10 % 10, shape % 10
        blocks = -(-S // nj) * -(-B // (8 * rt * row_warps))
        if blocks > torch.cuda.get_device_properties(0).multi_processor_count:
            pytest.skip("that block shape's grid may not be resident at once here")
    gen = torch.Generator().manual_seed(sum(size) + (shape or 0) + packed)
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    args = make_args(T, B, F, S, dtype=torch.float32, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    bs = batch_sizes_of(lengths, T) if packed else None
    chunks = min(2, T)
    out = []

    def run():
        out.extend(run_op(*args, bs)[:3])
        torch.autograd.backward(out, [g.to("cuda", torch.float32) for g in grads])

    shape_env = {} if shape is None else {"LLTM_OP_SEQUENCE_RESIDENT_SHAPE": shape}
    with env(LLTM_OP_SEQUENCE_CHUNKS=chunks, LLTM_OP_SEQUENCE_LOCAL=0, **shape_env), tf32_matmul(False):
        names = _cuda_kernel_names(run)
    assert sum("forward_resident_kernel" in n for n in names) == 1, names
    assert sum("backward_resident_kernel" in n for n in names) == chunks, names
    assert not any("cell_kernel" in n or "fused_kernel" in n or "persistent_kernel" in n for n in names), names
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("B", "S", "tf32", "training", "inference"),
    [
        (32, 1024, False, True, True),  # B S^2 = 2^25, 4B <= S
        (128, 512, False, True, True),
        (129, 512, False, False, False),  # 4B > S
        (512, 256, False, False, False),
        (33, 1024, False, False, True),  # past 2^25: an inference run, 16B <= S
        (64, 1024, False, False, True),  # 2^26
        (65, 1024, False, False, False),
        (32, 1020, True, False, False),  # TF32 (S off the tensor-core kernels' 8): cuBLAS
    ],
    ids=str,
)
def test_cuda_float32_takes_the_resident_kernels_by_the_size_rule(B, S, tf32, training, inference):
    """Full float32 past the fused path's 2^26 multiply-adds a step runs the
    resident-weight kernels where the batch is narrow against the state:
    B S^2 <= 2^25 with 4B <= S, and an inference run up to 2^26 with 16B
    <= S; a cuBLAS product a step otherwise, and always on TF32. Either way
    the values (and a forward+backward's gradients) match float64. Skipped
    where the resident grid does not fit this GPU at that size."""
    need("cuda")
    T, F = 3, 8
    inputs = make_args(T, B, F, S, dtype=torch.float32, device="cuda", generator=torch.Generator().manual_seed(B + S))
    limit = TF32_LIMIT if tf32 else LIMITS[torch.float32]

    def infer():
        with torch.no_grad():
            return flat(lltm_sequence(*inputs))

    with tf32_matmul(tf32):
        with env(LLTM_OP_SEQUENCE_RESIDENT="1"):
            if sum("forward_resident_kernel" in n for n in _cuda_kernel_names(infer)) != 1:
                pytest.skip("the resident grid does not fit this GPU at this size")
        ref = _float64_results(inputs)
        run, got = _ones_backward(inputs)
        names = _cuda_kernel_names(run)
        assert sum("forward_resident_kernel" in n for n in names) == int(training), names
        assert any("backward_resident_kernel" in n for n in names) == training, names
        for name, g, r in zip(RESULT_NAMES, got, ref):
            assert rel_err(g.cpu(), r) <= limit, name
        names = _cuda_kernel_names(infer)
        assert sum("forward_resident_kernel" in n for n in names) == int(inference), names
        for name, g, r in zip(RESULT_NAMES, infer(), ref):
            assert rel_err(g.cpu(), r) <= limit, name


def runs_fma_local(S: int, B: int, cluster: int | None = None) -> bool:
    """Whether full-precision float32 runs the block-local FMA kernels at
    state size S and batch B on this GPU (the rule of
    compute_fma_local_launch, for grids that fit): S a multiple of 8, up to
    32 in one block, up to 128 in clusters (sm_90; of `cluster` blocks
    where asked, at most 4 column tiles a block; past S = 64 clusters of 8
    where they take at most half the multiprocessors, else 4), 8 rows a
    cluster, one block a multiprocessor."""
    if S % 8 != 0 or S > 128:
        return False
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clusters = (B + 7) // 8
    if torch.cuda.get_device_capability()[0] < 9:
        return S <= 32 and cluster in (None, 1) and clusters <= sms
    C = fma_cluster(S, B, cluster)
    tiles_a_block = ((S + 7) // 8 + C - 1) // C
    return tiles_a_block <= 4 and (C > 1 or S <= 32) and clusters * C <= sms


def fma_cluster(S: int, B: int, cluster: int | None = None) -> int:
    """The blocks a cluster of the block-local FMA kernels on sm_90 (see
    runs_fma_local)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    clusters = (B + 7) // 8
    return cluster or (1 if S <= 32 else 2 if S <= 64 else 8 if clusters * 8 <= sms // 2 else 4)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "size",
    [
        (5, 3, 4, 8),
        (1, 5, 3, 16),
        (7, 1, 5, 24),
        (3, 70, 9, 40),
        (4, 16, 8, 64),
        (4, 20, 6, 96),
        (6, 9, 8, 120),
        (2, 33, 16, 128),
        (2, 250, 8, 128),
        (3, 300, 32, 64),
    ],
    ids=str,
)
@pytest.mark.parametrize("cluster", [None, 8], ids=["rule", "C8"])
@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
@pytest.mark.parametrize("split", [None, 2], ids=["rule_split", "at_most_two_warps_a_tile"])
def test_cuda_fma_local_kernels_run_and_match_the_reference(size, cluster, packed, split):
    """Full-precision float32 (no TF32) on the block-local kernels with the
    product on the FMA units (8 batch rows a cluster, each warp's weights in
    registers, k split over 8 lanes and summed by shuffles): they run (one
    launch for the forward, one per backward chunk) and match float64 to
    float32's error, on S = 8 to 128 (one block, clusters of 2 and 4, a
    last block with fewer tiles at S = 120, clusters of 8: the rule's past
    S = 64 at small B, or asked; two warps a tile at S > 64, one where
    those clusters do not all fit; the backward's four where a block has at
    most 2 tiles past S = 64, unless LLTM_OP_SEQUENCE_FMA_SPLIT=2),
    B = 1, 3, 5 (part of one 8-row block), 9, 33, 70, 250, 300 (several, a
    part-filled last one), T = 1, packed rows, two backward chunks."""
    need("cuda")
    T, B, F, S = size
    if not runs_fma_local(S, B, cluster):
        pytest.skip("those block-local kernels do not run at this size on this GPU")
    C = fma_cluster(S, B, cluster)
    backward_on_four = S > 64 and C > 1 and ((S + 7) // 8 + C - 1) // C <= 2  # the rule's
    if split == 2 and not backward_on_four:
        pytest.skip("the rule's split is at most two here")
    four = split is None and backward_on_four
    gen = torch.Generator().manual_seed(sum(size) + packed)
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    args = make_args(T, B, F, S, dtype=torch.float32, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    bs = batch_sizes_of(lengths, T) if packed else None
    chunks = min(2, T)
    out = []

    def run():
        out.extend(run_op(*args, bs)[:3])
        torch.autograd.backward(out, [g.to("cuda", torch.float32) for g in grads])

    cluster_env = {} if cluster is None else {"LLTM_OP_SEQUENCE_LOCAL_CLUSTER": cluster}
    split_env = {} if split is None else {"LLTM_OP_SEQUENCE_FMA_SPLIT": split}
    with env(LLTM_OP_SEQUENCE_CHUNKS=chunks, **cluster_env, **split_env), tf32_matmul(False):
        names = _cuda_kernel_names(run)
    assert sum("forward_fma_local_kernel" in n for n in names) == 1, names
    # kSplit: the last template argument.
    fma = _tc_kernel_args(names, "fma_local")
    # The backward by partial sums runs exactly where its shape is built for
    # the backward's warps a block: its tiles times the warps a tile that the
    # rule gave it (backward_local's kSplit; the rule takes fewer where the
    # clusters of more do not fit, as at B250 on an H200).
    tiles_a_block = ((S + 7) // 8 + C - 1) // C
    local_backward = [a for kind, a in fma if kind == "backward"]
    partial = [a for _, a in _tc_kernel_args(names, "fma_partial")]
    assert len(local_backward) + len(partial) == chunks, names
    for a in local_backward:
        assert not partial_backward_built(S, C, tiles_a_block * int(a[-1]), True, 8, packed), a
    for kb, nto in partial:
        assert int(kb) == tiles_a_block and partial_backward_built(S, C, S // 8 // int(nto), True, 8, packed)
    assert all((a[-1] == "4") == (four and kind == "backward") for kind, a in fma), fma
    assert count_tc(names, "forward") == count_tc(names, "backward") == 0, names
    assert not any("resident_kernel" in n or "cell_kernel" in n or "fused_kernel" in n for n in names), names
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, 1e-5)


def partial_backward_built(
    S: int, C: int, warps: int, fma: bool, rows: int = 8, packed: bool = False, wide: bool = False
) -> bool:
    """Whether the cluster backward of C blocks of `warps` warps at state
    size S runs by partial sums (tc::backward_partial; the rule of
    use_partial_sums and partial_shape): a whole batch, 8 rows a cluster,
    every block the same tiles (kb) and every warp the same columns (nto
    tiles), in a shape that is built: on the FMA units (fma) past S = 64
    (its small-K variant keeps backward_local) kb 2 or 4 and nto 2, on the
    tensor cores kb 4 and nto 4 or kb 8 and nto 2, and in 16-bit types
    (wide) kb 4 and nto 8."""
    if packed or rows != 8 or C < 2 or warps < 1 or S % (8 * C) != 0 or (S // 8) % warps != 0:
        return False
    if fma and S <= 64:
        return False
    kb, nto = S // 8 // C, S // 8 // warps
    if fma:
        return nto == 2 and kb in (2, 4)
    return (kb, nto) in ((4, 4), (8, 2)) or (wide and (kb, nto) == (4, 8))


# The backward by partial sums' cases: dtype and TF32 (float32 without it
# runs on the FMA units).
PARTIAL_CASES = {
    "f32_tf32": (torch.float32, True),
    "f32_full": (torch.float32, False),
    "bf16": (torch.bfloat16, True),
    "f16": (torch.float16, True),
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(PARTIAL_CASES))
@pytest.mark.parametrize("T,B", [(1, 3), (7, 37)], ids=str)
@pytest.mark.parametrize("cluster", [None, 2, 4, 8], ids=["rule", "C2", "C4", "C8"])
@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
@pytest.mark.parametrize("partial", ["1", "0"], ids=["partial_sums", "dG_pushed"])
def test_cuda_backward_by_partial_sums_matches_the_reference(case, T, B, cluster, packed, partial):
    """The cluster backward at S = 128 on 8 rows a cluster where each block
    pushes the partial sums of its dG's recurrent product, S values a row,
    instead of its dG (3S): it runs for whole batches where its shape is
    built (the tensor cores' clusters of 4 blocks, the rule's, and of 2;
    the FMA units' of 8, the rule's at these batches, and of 4), a packed
    batch and LLTM_OP_SEQUENCE_PARTIAL=0 run backward_local, and every run
    matches float64 within its dtype's error: T = 1 (no recurrent
    product), T = 7 over two backward chunks (the later chunk's last dG
    read from global memory), B = 3 and 37 (part-filled clusters)."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the cluster kernels need sm_90 or newer")
    dtype, tf32 = PARTIAL_CASES[case]
    fma = dtype == torch.float32 and not tf32
    S, F = 128, 6
    if fma and not runs_fma_local(S, B, cluster):
        pytest.skip("those block-local kernels do not run at this size on this GPU")
    C = fma_cluster(S, B, cluster) if fma else (cluster or 4)
    # Warps a block: the FMA backward's tiles times 4 warps a tile (2 where
    # a block has more than 2 tiles); the tensor cores' one a tile.
    tiles_a_block = 16 // C
    warps = tiles_a_block * (4 if tiles_a_block <= 2 else 2) if fma else tiles_a_block
    built = partial == "1" and partial_backward_built(S, C, warps, fma, 8, packed)
    gen = torch.Generator().manual_seed(T * B + C + packed)
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    bs = batch_sizes_of(lengths, T) if packed else None
    chunks = min(2, T)
    out = []

    def run():
        out.extend(run_op(*args, bs)[:3])
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

    cluster_env = {} if cluster is None else {"LLTM_OP_SEQUENCE_LOCAL_CLUSTER": cluster}
    with (
        env(LLTM_OP_SEQUENCE_PARTIAL=partial, LLTM_OP_SEQUENCE_CHUNKS=chunks, **cluster_env),
        tf32_matmul(tf32),
    ):
        names = _cuda_kernel_names(run)
    family = "fma" if fma else "tc"
    assert sum(f"backward_{family}_partial_kernel" in n for n in names) == (chunks if built else 0), names
    assert sum(f"backward_{family}_local_kernel" in n for n in names) == (0 if built else chunks), names
    limit = 1e-5 if fma else TF32_LIMIT if dtype == torch.float32 else LIMITS[dtype]
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)


# The packed runs' paths: PATHS, and float32 on TF32 tensor cores.
PACKED_PATHS = {**PATHS, "tf32": {"LLTM_OP_SEQUENCE_TENSOR_CORES": "1"}}


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(PACKED_PATHS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T,B,F,S", [(9, 70, 8, 64), (5, 5, 3, 40), (6, 33, 5, 33), (4, 300, 4, 16)], ids=str)
def test_cuda_paths_run_packed_rows(path, dtype, T, B, F, S):
    """A packed run (batch_sizes) on every CUDA step path, forced: the
    persistent and tensor-core kernels mask rows past their own length in
    their one launch (B = 70 and 300: several row tiles and batch blocks,
    rows ending inside a tile; lengths of 0; two backward chunks), the other
    paths run each step on its leading rows. Values and every gradient
    against rows run alone in float64."""
    need("cuda")
    if path == "tf32" and dtype != torch.float32:
        pytest.skip("TF32 is float32's")
    gen = torch.Generator().manual_seed(T * B + S)
    lengths = random_lengths(T, B, gen)
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    out = []

    def run():
        out.extend(run_op(*args, batch_sizes_of(lengths, T))[:3])
        torch.autograd.backward(out, [g.to("cuda", dtype) for g in grads])

    with env(**PACKED_PATHS[path], LLTM_OP_SEQUENCE_CHUNKS=2), tf32_matmul(path == "tf32"):
        names = _cuda_kernel_names(run)
    tc = torch.cuda.get_device_capability()[0] >= 8 and S % 8 == 0
    tc_path = path in ("tensor_cores", "tc_global", "tc_clusters", "tc_local_clusters")
    if path == "persistent" or (tc_path and dtype != torch.float64 and tc):
        # One launch for the forward, one per backward chunk: no step kernels.
        if tc_path and dtype != torch.float32:
            local = None if path in ("tensor_cores", "tc_local_clusters") else False
            assert count_tc(names, "forward", local) == 1, names
            assert count_tc(names, "backward", local) == 2, names
        elif tc_path:
            # float32 without TF32: the block-local FMA kernels where they
            # run, else the resident-weight kernels (S % 4 == 0).
            cluster = {"tensor_cores": None, "tc_local_clusters": 4}.get(path, 0)
            kind = "fma_local" if cluster != 0 and runs_fma_local(S, B, cluster) else "resident"
            assert sum(f"forward_{kind}_kernel" in n for n in names) == 1, names
            assert sum(f"backward_{kind}_kernel" in n for n in names) == 2, names
        else:
            assert sum("forward_persistent_kernel" in n for n in names) == 1, names
            assert sum("backward_persistent_kernel" in n for n in names) == 2, names
        assert not any("cell_kernel" in n for n in names), names
    if path == "tf32" and tc:
        assert count_tc(names, "forward") == 1, names
    if path == "resident" and dtype == torch.float32 and S % 4 == 0:
        assert sum("forward_resident_kernel" in n for n in names) == 1, names
        assert sum("backward_resident_kernel" in n for n in names) == 2, names
        assert not any("cell_kernel" in n for n in names), names
    limit = LIMITS[dtype]
    if path == "tf32":
        limit = TF32_LIMIT
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("T,B,F,S", [(7, 8, 8, 64), (5, 40, 8, 128), (3, 3, 4, 8)], ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
def test_cuda_forward_cluster_variant_matches_the_global_barrier_kernel(dtype, T, B, F, S, packed):
    """On sm_90, asked for (LLTM_OP_SEQUENCE_CLUSTERS=1), the tensor-core
    forward runs as one thread-block cluster per batch block (h exchanged in
    distributed shared memory) where its column blocks fit one cluster: same
    block shape and arithmetic as the global-barrier kernel, so the same
    bits."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90 or newer")
    gen = torch.Generator().manual_seed(T + B + S)
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=gen)
    bs = None
    if packed:
        bs = batch_sizes_of(random_lengths(T, B, gen), T)
    runs = {}
    for clusters in ("1", "0"):
        with (
            env(LLTM_OP_SEQUENCE_TENSOR_CORES="1", LLTM_OP_SEQUENCE_LOCAL="0", LLTM_OP_SEQUENCE_CLUSTERS=clusters),
            tf32_matmul(True),
        ):
            got = []
            # The op itself (a no-grad run_op would take sequence_inference).
            names = _cuda_kernel_names(lambda got=got: got.extend(seq_forward(*args, True, bs)[:3]))
        forward = [n for n in names if "forward_tc_kernel<" in n]
        assert len(forward) == 1, names
        # The kernel's fourth template argument is kCluster.
        cluster_arg = re.search(r"forward_tc_kernel<[^,]+, \d+, \w+, (\w+)", forward[0])
        assert cluster_arg is not None and cluster_arg[1] == ("true" if clusters == "1" else "false"), forward
        runs[clusters] = got
    for name, a, b in zip(("outputs", "h_n", "c_n"), runs["1"], runs["0"]):
        assert torch.equal(a, b), name


@pytest.mark.cuda
def test_cuda_float32_uses_tf32_only_where_torch_allows_it():
    """float32 follows torch's float32 matmul setting: with TF32 off (torch's
    default, precision "highest") no tensor-core kernel runs and the result
    has float32's accuracy; with it on (precision "high") the TF32 kernels
    run, also when the call is traced by torch.compile."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernels need sm_80 or newer")
    T, B, F, S = 6, 16, 8, 64
    args = make_args(T, B, F, S, dtype=torch.float32, device="cuda", generator=torch.Generator().manual_seed(3))
    want = flat(reference(*(t.double().cpu() for t in args)))
    compiled = torch.compile(lltm_sequence, fullgraph=True, dynamic=False)
    for allowed, run in ((False, lltm_sequence), (True, lltm_sequence), (False, compiled), (True, compiled)):
        got = []
        with tf32_matmul(allowed):
            names = _cuda_kernel_names(lambda run=run, got=got: got.extend(flat(run(*args))))
        assert (count_tc(names, "forward") > 0) == allowed, (allowed, names)
        limit = TF32_LIMIT if allowed else LIMITS[torch.float32]
        for g, r in zip(got, want):
            assert rel_err(g.cpu().double(), r) <= limit, allowed
    with tf32_matmul(False):
        torch.set_float32_matmul_precision("high")
        try:
            names = _cuda_kernel_names(lambda: lltm_sequence(*args))
        finally:
            torch.set_float32_matmul_precision("highest")
    assert count_tc(names, "forward") > 0, names


# float32 with and without TF32 and the half types: which products run on
# tensor cores (and so through cuBLASLt).
TENSOR_CORE_PRECISIONS = pytest.mark.parametrize(
    "dtype,tf32",
    [(torch.float32, False), (torch.float32, True), (torch.float16, False), (torch.bfloat16, False)],
    ids=["float32", "float32-tf32", "float16", "bfloat16"],
)


def _uses_tf32_kernels(names: list[str]) -> bool:
    """Whether cuBLAS ran TF32 kernels: it names them so (tf32 in the name,
    or s1688 / tf32 tensor-op CUTLASS kernels)."""
    return any("tf32" in n or "s1688" in n for n in names)


def _op_calls(fn) -> tuple[collections.Counter, list[str]]:
    """The calls through torch's dispatcher in fn (the op's own included),
    counted by op name ("aten::mm"), and the CUDA kernels fn ran."""
    events = _profiled_events(fn, cpu=True)
    return collections.Counter(e.name for e in events), _kernel_names(events)


# What _ones_backward and _float64_results return, in order.
RESULT_NAMES = ("outputs", "h_n", "c_n") + tuple(
    f"grad of {n}" for n in ("input", "weights", "bias", "old_h", "old_cell")
)


def _ones_backward(inputs) -> tuple:
    """A forward+backward of lltm_sequence on copies of `inputs`, gradients
    of ones into every output, as a function of no arguments (to run under
    a profiler or settings), and the list it fills: outputs, h_n, c_n and
    the five gradients (RESULT_NAMES)."""
    args = [t.detach().clone().requires_grad_() for t in inputs]
    results = []

    def run():
        out = flat(lltm_sequence(*args))
        torch.autograd.backward(out, [torch.ones_like(o) for o in out])
        results.extend([o.detach() for o in out] + [a.grad for a in args])

    return run, results


def _float64_results(inputs, device: str = "cpu") -> list[torch.Tensor]:
    """The loop of cells in float64 on `device`, as _ones_backward's list."""
    args = [t.detach().to(device, torch.float64).requires_grad_() for t in inputs]
    ref = flat(reference(*args))
    torch.autograd.backward(ref, [torch.ones_like(r) for r in ref])
    return [r.detach() for r in ref] + [a.grad for a in args]


@pytest.mark.cuda
@TENSOR_CORE_PRECISIONS
def test_cuda_cublas_path_runs_its_forward_products_in_cublaslt(dtype, tf32):
    """On the cuBLAS path the forward's step products on tensor cores (h
    W_h^T, added into the gates; float16, bfloat16, float32 on TF32) go to
    cuBLASLt, not through torch's dispatcher: six more steps make six more
    aten::mm calls (the backward's), twelve with LLTM_OP_SEQUENCE_CUBLASLT=0
    or in full float32. float32 uses TF32 kernels exactly where torch allows
    them; values and gradients match float64 (B and S off every tile)."""
    need("cuda")
    F, S, B = 24, 200, 37
    gen = torch.Generator().manual_seed(5)
    calls, named = {}, {}
    for lt in ("1", "0"):
        for T in (4, 10):
            inputs = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=gen)
            run, got = _ones_backward(inputs)
            chunks = dict(LLTM_OP_SEQUENCE_CHUNKS="2")  # the same chunk products at both T
            with env(LLTM_OP_SEQUENCE_FUSED="0", LLTM_OP_SEQUENCE_CUBLASLT=lt, **chunks), tf32_matmul(tf32):
                counts, named[lt, T] = _op_calls(run)
            calls[lt, T] = counts["aten::mm"]
            limit = TF32_LIMIT if tf32 else LIMITS[dtype]
            for name, g, r in zip(RESULT_NAMES, got, _float64_results(inputs)):
                assert rel_err(g.cpu(), r) <= limit, (lt, T, name)
    cublaslt = dtype != torch.float32 or tf32
    assert calls["1", 10] - calls["1", 4] == (6 if cublaslt else 12), calls
    assert calls["0", 10] - calls["0", 4] == 12, calls
    if dtype == torch.float32:
        assert _uses_tf32_kernels(named["1", 10]) == tf32, named["1", 10]


def _chunk_product_calls(inputs, tf32: bool, limit: float) -> tuple[dict, dict]:
    """aten::mm calls and CUDA kernels of a forward+backward in two chunks,
    keyed by LLTM_OP_SEQUENCE_CUBLASLT_CHUNKS ("1": the chunk products
    through cuBLASLt where it takes them, "0": all through aten::mm);
    values and gradients checked against float64 both ways."""
    ref = _float64_results(inputs)
    calls, named = {}, {}
    for chunks in ("1", "0"):
        run, got = _ones_backward(inputs)
        with env(LLTM_OP_SEQUENCE_CUBLASLT_CHUNKS=chunks, LLTM_OP_SEQUENCE_CHUNKS="2"), tf32_matmul(tf32):
            counts, named[chunks] = _op_calls(run)
        calls[chunks] = counts["aten::mm"]
        for name, g, r in zip(RESULT_NAMES, got, ref):
            assert rel_err(g.cpu(), r) <= limit, (chunks, name)
    return calls, named


@pytest.mark.cuda
@TENSOR_CORE_PRECISIONS
def test_cuda_chunk_products_run_in_cublaslt(dtype, tf32):
    """A small call's large products (the input projection, the weight and
    input gradients of each backward chunk, d_old_h) go to cuBLASLt, the
    second chunk's weight gradients added into the first's: no aten::mm
    call is left with two chunks, nine without cuBLASLt
    (LLTM_OP_SEQUENCE_CUBLASLT_CHUNKS=0). Full float32 runs no TF32 kernel
    either way. Values and gradients match float64 either way (B, S and F
    off every tile)."""
    need("cuda")
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("bfloat16 products on tensor cores need sm_80 or newer")
    T, B, F, S = 6, 5, 20, 24
    inputs = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(7))
    calls, named = _chunk_product_calls(inputs, tf32, TF32_LIMIT if tf32 else LIMITS[dtype])
    assert calls == {"1": 0, "0": 9}, calls
    if dtype == torch.float32 and not tf32:
        assert not any(_uses_tf32_kernels(names) for names in named.values()), named


@pytest.mark.cuda
def test_cuda_full_float32_long_weight_gradients_stay_with_aten_mm():
    """Full float32's weight-gradient products (K = steps x B, long against
    M = 3S and N) past 2^25 multiply-adds go to aten::mm, the rest of a
    call's chunk products to cuBLASLt: four aten::mm calls with two chunks
    here (each chunk's dW_x and the dW_h over its steps past the first; the
    first step's dW_h, over B rows, stays in cuBLASLt), nine with
    LLTM_OP_SEQUENCE_CUBLASLT_CHUNKS=0. No TF32 kernel runs; values and
    gradients match float64."""
    need("cuda")
    T, B, F, S = 64, 96, 64, 64  # dW_h: 3S x S x (32 - 1) B = 36.6M multiply-adds
    inputs = make_args(T, B, F, S, dtype=torch.float32, device="cuda", generator=torch.Generator().manual_seed(9))
    calls, named = _chunk_product_calls(inputs, False, LIMITS[torch.float32])
    assert calls == {"1": 4, "0": 9}, calls
    assert not any(_uses_tf32_kernels(names) for names in named.values()), named


@pytest.mark.cuda
@pytest.mark.parametrize("cublaslt", ["1", "0"])
@pytest.mark.parametrize(
    ("S", "splits", "forward_split", "backward_split"),
    [(64, "4", True, True), (50, "3", False, True), (50, "2", True, True), (24, "72", False, True)],
)
def test_cuda_full_float32_step_products_in_parts_of_k_match_float64(
    S, splits, forward_split, backward_split, cublaslt
):
    """Full float32's step products on the cuBLAS path in parts of k
    (LLTM_OP_SEQUENCE_STEP_SPLITS=s) where s divides k (forward K = S,
    backward 3S): one batched cublasLtMatmul of s partial products a step
    (one aten::bmm with LLTM_OP_SEQUENCE_CUBLASLT=0), added up by the cell
    kernels; one aten::mm a step otherwise. Counted against one product a
    step (s = 1): the split steps leave aten::mm. Outputs and all five
    gradients match float64 either way (B and S off every tile, a part of
    a single k)."""
    need("cuda")
    T, B, F = 5, 37, 20
    inputs = make_args(T, B, F, S, dtype=torch.float32, device="cuda", generator=torch.Generator().manual_seed(13))
    ref = _float64_results(inputs)
    calls = {}
    for parts in (splits, "1"):
        run, got = _ones_backward(inputs)
        settings = dict(LLTM_OP_SEQUENCE_STEP_SPLITS=parts, LLTM_OP_SEQUENCE_CUBLASLT=cublaslt)
        with env(LLTM_OP_SEQUENCE_FUSED="0", **settings), tf32_matmul(False):
            calls[parts], _ = _op_calls(run)
        for name, g, r in zip(RESULT_NAMES, got, ref):
            assert rel_err(g.cpu(), r) <= LIMITS[torch.float32], (parts, name)
    split_steps = T * forward_split + (T - 1) * backward_split
    assert calls["1"]["aten::mm"] - calls[splits]["aten::mm"] == split_steps, calls
    assert calls[splits]["aten::bmm"] == (split_steps if cublaslt == "0" else 0), calls
    assert calls["1"]["aten::bmm"] == 0, calls


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("T", "B", "S", "tf32", "forward_split"),
    [
        (180, 64, 1024, False, True),
        (64, 64, 1024, False, False),
        (64, 64, 1024, True, False),
        (64, 256, 512, False, True),
        (32, 256, 512, False, False),
    ],
)
def test_cuda_float32_step_products_split_by_the_rule(T, B, S, tf32, forward_split):
    """The rule's parts of k in float32 on the cuBLAS path: in full float32
    forward, where their partials past one product fit the call's bound on
    them (T x B x S x 4 / 4 bytes), 8 parts at B64 S1024 (T180, not T64)
    and 4 at B256 S512 (T64, not T32); none on TF32 (the forward's product
    goes to cuBLASLt whole); 8 backward at these sizes either way. Each
    step's parts are one batched cublasLtMatmul: against one product a step
    (LLTM_OP_SEQUENCE_STEP_SPLITS=1) the split steps leave aten::mm.
    Outputs and gradients are within twice the error of one product a step
    against float64 (on the GPU: this many steps of S1024 would take
    minutes on the CPU), or the precision's limit."""
    need("cuda")
    F = 32
    inputs = make_args(T, B, F, S, dtype=torch.float32, device="cuda", generator=torch.Generator().manual_seed(17))
    ref = _float64_results(inputs, "cuda")
    errors, calls = {}, {}
    for splits in ("", "1"):
        run, got = _ones_backward(inputs)
        with env(LLTM_OP_SEQUENCE_FUSED="0", LLTM_OP_SEQUENCE_STEP_SPLITS=splits), tf32_matmul(tf32):
            calls[splits], _ = _op_calls(run)
        errors[splits] = [rel_err(g, r) for g, r in zip(got, ref)]
    assert calls["1"]["aten::mm"] - calls[""]["aten::mm"] == T * forward_split + T - 1, calls
    assert calls[""]["aten::bmm"] == calls["1"]["aten::bmm"] == 0, calls
    limit = TF32_LIMIT if tf32 else LIMITS[torch.float32]
    for name, split, one in zip(RESULT_NAMES, errors[""], errors["1"]):
        assert split <= max(2 * one, limit), (name, split, one)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_cublas_path_cell_kernels_launched_early_match_plain_launches(dtype):
    """The cuBLAS path's cell kernels may launch before the step product
    ahead of them finishes (programmatic dependent launch, sm_90+) and wait
    for it inside the kernel: outputs and all five gradients equal those of
    plain launches (LLTM_OP_SEQUENCE_PDL=0) bit for bit, and float64's
    within the dtype's error. Before sm_90 both runs are plain launches."""
    need("cuda")
    T, B, F, S = 8, 64, 24, 515  # products long enough that an early start would race
    inputs = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(11))
    got = {}
    for pdl in ("1", "0"):
        run, got[pdl] = _ones_backward(inputs)
        with env(LLTM_OP_SEQUENCE_FUSED="0", LLTM_OP_SEQUENCE_PDL=pdl):
            run()
    for name, a, b in zip(RESULT_NAMES, got["1"], got["0"]):
        assert torch.equal(a, b), name
    for name, g, r in zip(RESULT_NAMES, got["1"], _float64_results(inputs)):
        assert rel_err(g.cpu(), r) <= LIMITS[dtype], name


@pytest.mark.cuda
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize(
    ("B", "S", "splits", "packed"),
    [(37, 64, "4", False), (5, 48, "12", False), (3, 24, "2", True), (6, 30, "2", False), (4, 64, "1", False)],
    ids=str,
)
def test_cuda_cublas_path_vectorized_cells_match_the_scalar_cells(B, S, splits, packed, grad):
    """Full float32 on the cuBLAS path with its step products in parts of k
    (LLTM_OP_SEQUENCE_STEP_SPLITS): the forward cells run in 16-byte
    accesses where S is whole vectors of 4, and the outputs (and in
    training all five gradients) equal those of the element-wise kernel
    (LLTM_OP_SEQUENCE_CELL_VEC=0) bit for bit, and float64's within
    float32's error: 4 parts, 12 (past the 8 whose loads go together),
    inference. Which kernel ran, a step: the vectorized one exactly where S
    is whole vectors and the product comes in parts (S = 30, one product a
    step and a packed run, which takes one, keep the element-wise kernel)."""
    need("cuda")
    T, F = 6, 9
    gen = torch.Generator().manual_seed(B * 100 + S)
    lengths = random_lengths(T, B, gen) if packed else [T] * B
    bs = batch_sizes_of(lengths, T) if packed else None
    base = make_args(T, B, F, S, dtype=torch.float32, device="cuda", generator=gen)
    for r, n in enumerate(lengths):
        base[0][n:, r] = 0
    grads = [torch.randn(shape, generator=gen).to("cuda") for shape in ((T, B, S), (B, S), (B, S))]
    results, names = {}, {}
    for vec in ("1", "0"):
        args = [t.detach().clone().requires_grad_(grad) for t in base]

        def run():
            with torch.set_grad_enabled(grad):
                out = run_op(*args, bs)[:3]
            if grad:
                torch.autograd.backward(list(out), grads)
            results[vec] = [o.detach() for o in out] + ([a.grad for a in args] if grad else [])

        settings = dict(LLTM_OP_SEQUENCE_STEP_SPLITS=splits, LLTM_OP_SEQUENCE_CELL_VEC=vec)
        with env(LLTM_OP_SEQUENCE_FUSED="0", **settings), tf32_matmul(False):
            names[vec] = _cuda_kernel_names(run)
    for name, a, b in zip(RESULT_NAMES, results["1"], results["0"]):
        assert torch.equal(a, b), name
    vectorizes = S % 4 == 0 and int(splits) > 1 and not packed
    for vec in ("1", "0"):
        ran = [n for n in names[vec] if "forward_cell_" in n]
        vectorized = [n for n in ran if "forward_cell_vec_kernel" in n]
        assert len(ran) == T and len(vectorized) == (T if vectorizes and vec == "1" else 0), ran
    ref_args = [t.detach().double().cpu().requires_grad_() for t in base]
    ref = packed_reference(ref_args, lengths)
    torch.autograd.backward(ref, [g.double().cpu() for g in grads])
    expected = [*ref, *(a.grad for a in ref_args)] if grad else ref
    for name, g, r in zip(RESULT_NAMES, results["1"], expected):
        assert rel_err(g.cpu(), r) <= LIMITS[torch.float32], name


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("dtype", "tf32", "splits", "S"),
    [
        (torch.float32, False, "4", 64),  # parts of k: the 16-byte cell kernel
        (torch.float32, False, "1", 40),  # one product a step (aten::mm)
        (torch.float32, True, "", 48),  # TF32: the product added into the gates (cuBLASLt)
        (torch.bfloat16, False, "", 24),
    ],
    ids=str,
)
def test_cuda_cublas_path_inference_cells_leave_out_the_gates(dtype, tf32, splits, S):
    """On the cuBLAS path an inference step's cell kernel does not store the
    pre-activations back (nothing reads them after it; its variant with
    kKeepGates false runs at every step, the training forward's with true),
    and the inference op's outputs and final state (one chunk: the same
    products) equal the training forward's bit for bit.
    test_cuda_paths_run_inference_in_chunks covers chunks."""
    need("cuda")
    T, B, F = 7, 5, 9
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(S))
    with env(LLTM_OP_SEQUENCE_FUSED="0", LLTM_OP_SEQUENCE_STEP_SPLITS=splits, LLTM_OP_SEQUENCE_INFERENCE_CHUNKS="1"):
        with tf32_matmul(tf32):
            want = seq_forward(*args, tf32)[:3]
            got = torch.ops.lltm_op.sequence_inference(*args, tf32)
            names = {
                "training": _cuda_kernel_names(lambda: seq_forward(*args, tf32)),
                "inference": _cuda_kernel_names(lambda: torch.ops.lltm_op.sequence_inference(*args, tf32)),
            }
    for name, g, w in zip(("outputs", "h_n", "c_n"), got, want):
        assert torch.equal(g, w), name
    for mode, keep in (("training", "true"), ("inference", "false")):
        cells = [n for n in names[mode] if "forward_cell_" in n]
        assert len(cells) == T and all(f"{keep}>" in n for n in cells), (mode, cells)


@pytest.mark.cuda
def test_cuda_tensor_core_kernels_read_a_misaligned_initial_state():
    """old_h that starts at an odd element (a contiguous view of a larger
    buffer): the kernel reads h in 16-byte loads, so it gets an aligned copy."""
    need("cuda")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("the tensor-core kernels need sm_80 or newer")
    T, B, F, S = 4, 8, 8, 16
    x, w, b, h0, c0 = make_args(T, B, F, S, dtype=torch.bfloat16, device="cuda")
    h_odd = torch.empty(B * S + 1, dtype=torch.bfloat16, device="cuda")[1:].view(B, S)
    h_odd.copy_(h0)
    assert h_odd.data_ptr() % 16 != 0
    with env(LLTM_OP_SEQUENCE_TENSOR_CORES="1"):
        got = flat(lltm_sequence(x, w, b, h_odd, c0))
    want = flat(reference(*(t.double() for t in (x, w, b, h0, c0))))
    for g, r in zip(got, want):
        assert rel_err(g.double(), r) <= 3e-2


@pytest.mark.cuda
def test_cuda_paths_agree_with_the_cpu():
    need("cuda")
    args = make_args(12, 20, 16, 48, dtype=torch.float64)
    cpu = [t.requires_grad_() for t in (a.clone() for a in args)]
    out_cpu = flat(lltm_sequence(*cpu))
    sum((o * (i + 1)).sum() for i, o in enumerate(out_cpu)).backward()
    for path in PATHS.values():
        with env(**path):
            gpu = [t.cuda().requires_grad_() for t in args]
            out = flat(lltm_sequence(*gpu))
            sum((o * (i + 1)).sum() for i, o in enumerate(out)).backward()
        for o, w in zip(out, out_cpu):
            torch.testing.assert_close(o.cpu(), w.detach())
        for a, w in zip(gpu, cpu):
            torch.testing.assert_close(a.grad.cpu(), w.grad)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_cuda_persistent_kernels_launch_once_and_match_the_step_kernels(dtype):
    """The persistent kernels run (one launch for the forward, one per
    backward chunk) and give bit for bit what the fused step kernels give."""
    need("cuda")
    T, B, F, S, chunks = 24, 16, 32, 128, 3
    args = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(7))
    grads = [torch.randn(s, device="cuda", dtype=dtype) for s in ((T, B, S), (B, S), (B, S))]
    results = {}
    for path in ("fused", "persistent"):
        with env(**PATHS[path], LLTM_OP_SEQUENCE_CHUNKS=chunks):
            a = [t.clone().requires_grad_() for t in args]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = flat(lltm_sequence(*a))
                torch.autograd.backward(out, grads)
                torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        results[path] = ([o.detach() for o in out] + [t.grad for t in a], names)
    for path, (_, names) in results.items():
        persistent = sum(1 for n in names if "persistent_kernel" in n)
        per_step = sum(1 for n in names if "fused_kernel" in n)
        if path == "persistent":
            assert (persistent, per_step) == (1 + chunks, 0), (persistent, per_step)
        else:
            assert (persistent, per_step) == (0, 2 * T), (persistent, per_step)
    for g, w in zip(results["persistent"][0], results["fused"][0]):
        assert torch.equal(g, w)


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_graph_captures_forward_and_backward(path, dtype):
    need("cuda")
    T, B, F, S = 8, 16, 32, 128
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    with env(**PATHS[path]):
        static = [t.requires_grad_() for t in make_args(T, B, F, S, dtype=dtype, device="cuda")]
        grads = [torch.randn(s, device="cuda", dtype=dtype) for s in ((T, B, S), (B, S), (B, S))]

        def step(*a):
            out = flat(lltm_sequence(*a))
            torch.autograd.backward(out, grads)
            return out

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                for t in static:
                    t.grad = None
                step(*static)
        torch.cuda.current_stream().wait_stream(side)
        for t in static:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(*static)
        for seed in range(3):
            values = make_args(T, B, F, S, dtype=dtype, device="cuda", generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                for s, v in zip(static, values):
                    s.copy_(v)
            graph.replay()
            torch.cuda.synchronize()
            got = [o.detach().clone() for o in static_out] + [t.grad.clone() for t in static]
            fresh = [v.clone().requires_grad_() for v in values]
            want = [o.detach() for o in step(*fresh)] + [t.grad for t in fresh]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, **tol)


@pytest.mark.cuda
def test_cuda_compile_reduce_overhead():
    need("cuda")
    torch._dynamo.reset()
    args = make_args(6, 8, 12, 32, device="cuda")
    compiled = torch.compile(lambda *a: flat(lltm_sequence(*a)), mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        a = [t.clone().requires_grad_() for t in args]
        out = compiled(*a)
        sum(o.sum() for o in out).backward()
        b = [t.clone().requires_grad_() for t in args]
        want = flat(lltm_sequence(*b))
        sum(o.sum() for o in want).backward()
        for x, y in zip(
            [o.detach().clone() for o in out] + [t.grad for t in a], [o.detach() for o in want] + [t.grad for t in b]
        ):
            torch.testing.assert_close(x, y)


def loop_of_cells(x, w, b, h, c):
    outs = []
    for t in range(x.shape[0]):
        h, c = lltm(x[t], w, b, h, c)
        outs.append(h)
    return torch.stack(outs), (h, c)


def peak_bytes(fn, *args) -> int:
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


@pytest.mark.cuda
@TENSOR_CORE_PRECISIONS
@pytest.mark.parametrize(
    "size", [(64, 16, 32, 128), (32, 64, 128, 256), (2, 256, 1024, 1024), (64, 256, 512, 512)], ids=str
)
def test_cuda_peak_memory_at_most_the_loop_of_cells(size, dtype, tf32):
    """One forward+backward (gradients to all five arguments) allocates at
    peak no more than the loop of lltm_op cells, in every precision: the
    products that call cuBLASLt themselves (a small call's chunk products,
    the cuBLAS path's step products, on tensor cores) keep their workspace
    within the call's bound. (2, 256, 1024, 1024) runs the cuBLAS path, and
    (64, 256, 512, 512) in float32 without TF32 its step products in parts."""
    need("cuda")
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("bfloat16 products on tensor cores need sm_80 or newer")
    T, B, F, S = size
    args = [t.requires_grad_() for t in make_args(*size, dtype=dtype, device="cuda")]
    grads = [torch.randn(*shape, device="cuda", dtype=dtype) for shape in ((T, B, S), (B, S), (B, S))]

    def run(fn):
        def f():
            return torch.autograd.grad(flat(fn(*args)), args, grads)

        return f

    with tf32_matmul(tf32):
        run(lltm_sequence)(), run(loop_of_cells)()  # both warm: algorithms chosen, workspaces made
        ours = peak_bytes(run(lltm_sequence))
        loop = peak_bytes(run(loop_of_cells))
    assert ours <= loop, (ours, loop)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "size,dtype",
    [
        ((256, 32, 256, 256), torch.float32),
        ((256, 128, 64, 256), torch.bfloat16),
        ((512, 64, 512, 512), torch.float16),
        ((128, 256, 512, 512), torch.float32),
        ((128, 32, 1024, 1024), torch.float32),
        ((128, 256, 256, 256), torch.float16),
    ],
    ids=str,
)
def test_cuda_inference_peak_memory_at_most_the_loop_of_cells(size, dtype):
    """A forward with no gradient to give (torch.no_grad) keeps nothing for a
    backward: where the gates and cells of every step would take more than
    16 MiB and T >= 128 (chunks of at least 32 steps, a quarter of the
    steps; the cell states of two steps), at peak it allocates no more than
    the loop of lltm_op cells collecting its outputs (the forward that keeps
    them all allocates about 2.5 times that). At T128 it is the two cell
    slots that keep it under (the cuBLAS, resident-weight and block-local
    paths)."""
    need("cuda")
    args = make_args(*size, dtype=dtype, device="cuda")
    with torch.no_grad():
        ours = peak_bytes(lltm_sequence, *args)
        loop = peak_bytes(loop_of_cells, *args)
    assert ours <= loop, (ours, loop)


def seeded_case(device: str, dtype: torch.dtype, T: int, B: int, F: int, S: int, lengths):
    """A case seeded by its sizes: its generator, the arguments drawn from
    it and the batch sizes (None: whole); skipped where `device` is not
    there."""
    need(device)
    gen = torch.Generator().manual_seed(T * B + S)
    args = make_args(T, B, F, S, dtype=dtype, device=device, generator=gen)
    return gen, args, None if lengths is None else batch_sizes_of(lengths, T)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunks", ["1", "4", "3", "100"])
@pytest.mark.parametrize(
    "T,B,F,S,lengths", [(9, 5, 4, 16, None), (13, 6, 3, 8, [13, 12, 9, 4, 4, 0]), (1, 2, 3, 8, None)], ids=str
)
def test_inference_matches_the_forward(device, dtype, chunks, T, B, F, S, lengths):
    """sequence_inference (what a no-grad forward runs) gives sequence_forward's
    outputs and final state, whole and packed, with the steps in chunks of
    every length (LLTM_OP_SEQUENCE_INFERENCE_CHUNKS; 100: chunks of 2 steps)."""
    _, args, bs = seeded_case(device, dtype, T, B, F, S, lengths)
    if lengths is not None:
        for r, n in enumerate(lengths):
            args[0][n:, r] = 0
    want = seq_forward(*args, False, bs)[:3]
    with env(LLTM_OP_SEQUENCE_INFERENCE_CHUNKS=chunks):
        got = torch.ops.lltm_op.sequence_inference(*args, False, bs)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    for name, g, w in zip(("outputs", "h_n", "c_n"), got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)


def path_case(path: str, dtype: torch.dtype, T: int, B: int, F: int, S: int, lengths):
    """seeded_case for a forced CUDA path (PACKED_PATHS); skipped where
    TF32 meets a 16-bit dtype."""
    need("cuda")
    if path == "tf32" and dtype != torch.float32:
        pytest.skip("TF32 is float32's")
    return seeded_case("cuda", dtype, T, B, F, S, lengths)


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(PACKED_PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chunks", ["3", "100"])
@pytest.mark.parametrize("T,B,F,S,lengths", [(13, 5, 9, 40, None), (11, 6, 8, 64, [11, 10, 7, 4, 4, 1])], ids=str)
def test_cuda_paths_run_inference_in_chunks(path, dtype, chunks, T, B, F, S, lengths):
    """An inference run in chunks on every CUDA step path, forced: each
    chunk's kernels keep the cell states in two slots in turn and the next
    chunk starts from the last one's (chunks of 4 or 6 steps, and of 2; an
    odd number of steps last), whole and packed. Outputs and final state against the
    training forward on the same path, which keeps every step's."""
    _, args, bs = path_case(path, dtype, T, B, F, S, lengths)
    if lengths is not None:
        for r, n in enumerate(lengths):
            args[0][n:, r] = 0
    with env(**PACKED_PATHS[path]), tf32_matmul(path == "tf32"):
        want = seq_forward(*args, path == "tf32", bs)[:3]
        with env(LLTM_OP_SEQUENCE_INFERENCE_CHUNKS=chunks):
            got = torch.ops.lltm_op.sequence_inference(*args, path == "tf32", bs)
    tol = TF32_LIMIT if path == "tf32" else LIMITS[dtype]
    for name, g, w in zip(("outputs", "h_n", "c_n"), got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)


def grad_outputs_in(layout: str, T: int, B: int, S: int, like: torch.Tensor, gen) -> torch.Tensor:
    """A [T, B, S] output gradient that is not dense: a sum's (one value
    expanded), a mean over steps' ([B, S] expanded over T) or a batch_first
    module's (a [B, T, S] gradient transposed)."""
    shape, lay_out = {
        "sum": ((), lambda g: g.expand(T, B, S)),
        "expanded": ((B, S), lambda g: g.expand(T, B, S)),
        "transposed": ((B, T, S), lambda g: g.transpose(0, 1)),
    }[layout]
    return lay_out(torch.randn(shape, generator=gen).to(like))


def check_backward_of_any_layout(args, layout: str, bs, tf32: bool, gen) -> None:
    """sequence_backward of one forward, with an output gradient in
    `layout` (grad_outputs_in) and with the same values made dense first:
    the same five gradients, bit for bit."""
    T, B, _ = args[0].shape
    S = args[3].shape[1]
    outputs, _, _, gates, cells = seq_forward(*args, tf32, bs)
    go = grad_outputs_in(layout, T, B, S, outputs, gen)
    assert not go.is_contiguous()
    ghn, gcn = (torch.randn(B, S, generator=gen).to(outputs) for _ in range(2))
    saved = (args[0], args[1], args[3], args[4], outputs, gates, cells, True, tf32, bs)
    got = seq_backward(go, ghn, gcn, *saved)
    want = seq_backward(go.contiguous(), ghn, gcn, *saved)
    for name, g, w in zip(("d_input", "d_weights", "d_bias", "d_old_h", "d_old_cell"), got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["sum", "expanded", "transposed"])
@pytest.mark.parametrize("chunks", ["1", "2", "3"])
@pytest.mark.parametrize("T,B,F,S,lengths", [(7, 5, 4, 16, None), (7, 4, 3, 8, [7, 5, 3, 1])], ids=str)
def test_backward_takes_grad_outputs_of_any_layout(device, dtype, layout, chunks, T, B, F, S, lengths):
    """sequence_backward with an output gradient that is not dense (which
    it makes dense a chunk of steps at a time where the steps run in
    chunks) gives the gradients of the same values made dense first, bit for
    bit, whole and packed, in one chunk and in chunks of 4 and 3 steps
    (LLTM_OP_SEQUENCE_CHUNKS)."""
    gen, args, bs = seeded_case(device, dtype, T, B, F, S, lengths)
    with env(LLTM_OP_SEQUENCE_CHUNKS=chunks):
        check_backward_of_any_layout(args, layout, bs, False, gen)


@pytest.mark.cuda
@pytest.mark.parametrize("path", list(PACKED_PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["sum", "transposed"])
@pytest.mark.parametrize("T,B,F,S,lengths", [(11, 6, 8, 64, None), (11, 6, 8, 64, [11, 10, 7, 4, 4, 1])], ids=str)
def test_cuda_paths_take_grad_outputs_of_any_layout(path, dtype, layout, T, B, F, S, lengths):
    """Every CUDA step path, forced, in chunks of 4 steps: an output
    gradient that is not dense, made dense a chunk at a time, gives the
    gradients of the same values made dense first, bit for bit, whole and
    packed."""
    gen, args, bs = path_case(path, dtype, T, B, F, S, lengths)
    tf32 = path == "tf32"
    with env(**PACKED_PATHS[path], LLTM_OP_SEQUENCE_CHUNKS="3"), tf32_matmul(tf32):
        check_backward_of_any_layout(args, layout, bs, tf32, gen)


@pytest.mark.parametrize("device", DEVICES)
def test_no_grad_forward_runs_the_inference_op(device):
    """lltm_sequence with no gradient to give (no_grad, inference_mode, or
    no argument requiring grad) runs sequence_inference; with one it runs
    sequence_forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    need(device)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    args = make_args(5, 3, 4, 8, device=device)
    for ctx, grad in ((torch.no_grad, True), (torch.inference_mode, True), (contextlib.nullcontext, False)):
        inputs = [t.clone().requires_grad_(grad) for t in args]
        with ctx(), Ops() as ops:
            lltm_sequence(*inputs)
        assert "lltm_op.sequence_inference.default" in ops.names, (ctx, ops.names)
    with Ops() as ops:
        lltm_sequence(*[t.clone().requires_grad_() for t in args])
    assert "lltm_op.sequence_forward.default" in ops.names, ops.names
    assert "lltm_op.sequence_inference.default" not in ops.names, ops.names


@pytest.mark.parametrize("device", DEVICES)
def test_inference_op_refuses_a_gradient(device):
    """Called directly on tensors that require grad, sequence_inference's
    results cannot be differentiated: an error naming the op, never a
    silently missing gradient or tangent (backward, forward AD, torch.func's
    jvp and grad)."""
    import torch.autograd.forward_ad as fwAD

    need(device)
    op = torch.ops.lltm_op.sequence_inference
    message = r"lltm_op.sequence_inference: not differentiable"
    args = [t.requires_grad_() for t in make_args(4, 2, 3, 8, device=device)]
    outputs, h_n, c_n = op(*args)
    with pytest.raises(RuntimeError, match=message):
        (outputs.sum() + h_n.sum()).backward()
    plain = [t.detach() for t in args]
    with fwAD.dual_level(), pytest.raises(RuntimeError, match=message):
        op(fwAD.make_dual(plain[0], torch.randn_like(plain[0])), *plain[1:])
    with pytest.raises(RuntimeError, match=message):
        torch.func.jvp(lambda x: op(x, *plain[1:])[0], (plain[0],), (torch.randn_like(plain[0]),))
    with pytest.raises(RuntimeError, match=message):
        torch.func.grad(lambda x: op(x, *plain[1:])[0].sum())(plain[0])


@pytest.mark.parametrize("device", DEVICES)
def test_inference_op_names_a_bad_argument(device):
    """Bad input to sequence_inference is an error naming the op and the
    argument, as sequence_forward's."""
    need(device)
    x, w, b, h, c = make_args(4, 2, 3, 8, device=device)
    op = torch.ops.lltm_op.sequence_inference
    with pytest.raises(RuntimeError, match=r"lltm_op.sequence_inference: .*'weights'"):
        op(x, w.double(), b, h, c)
    with pytest.raises(RuntimeError, match=r"lltm_op.sequence_inference: .*'bias'"):
        op(x, w, b[:-1], h, c)
    with pytest.raises(RuntimeError, match=r"lltm_op.sequence_inference: argument 'batch_sizes' must hold"):
        op(x, w, b, h, c, False, torch.tensor([2, 3, 1, 0]))


@pytest.mark.parametrize("device", DEVICES)
def test_inference_op_under_vmap(device):
    """torch.func.vmap over sequence_inference: each sample's own run."""
    need(device)
    args = [torch.stack(s) for s in zip(*(make_args(4, 2, 3, 8, device=device) for _ in range(3)))]
    got = torch.func.vmap(torch.ops.lltm_op.sequence_inference.default)(*args)
    for k in range(3):
        want = torch.ops.lltm_op.sequence_inference(*(a[k] for a in args))
        for g, w in zip(got, want):
            torch.testing.assert_close(g[k], w)


@pytest.mark.parametrize("device", DEVICES)
def test_inference_opcheck(device):
    need(device)
    args = make_args(4, 3, 2, 8, dtype=torch.float64, device=device)
    torch.library.opcheck(torch.ops.lltm_op.sequence_inference.default, (*args, False, None))
    bs = batch_sizes_of([4, 3, 1], 4)
    torch.library.opcheck(torch.ops.lltm_op.sequence_inference.default, (*args, False, bs))


@pytest.mark.cuda
def test_cuda_follows_the_current_stream_without_syncs():
    need("cuda")
    args = [t.requires_grad_() for t in make_args(6, 8, 12, 32, device="cuda")]
    want = flat(lltm_sequence(*args))
    want_grads = torch.autograd.grad(want, args, [torch.ones_like(o) for o in want])
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            got = flat(lltm_sequence(*args))
            got_grads = torch.autograd.grad(got, args, [torch.ones_like(o) for o in got])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for g, w in zip([*got, *got_grads], [*want, *want_grads]):
        torch.testing.assert_close(g, w)


# -- batch_sizes: LLTMSequence's packed run, one op call ------------------------------------


def packed_reference(args, lengths):
    """Each row b run alone for its own lengths[b] steps (float64): outputs
    zero past its end, h_n / c_n those of its last step (the initial state
    for a length of 0)."""
    x, w, b, h0, c0 = args
    outs, hs, cs = [], [], []
    for r, n in enumerate(lengths):
        out, (h, c) = reference(x[:n, r : r + 1], w, b, h0[r : r + 1], c0[r : r + 1])
        outs.append(torch.cat((out, out.new_zeros(x.shape[0] - n, 1, out.shape[2]))))
        hs.append(h)
        cs.append(c)
    return torch.cat(outs, 1), torch.cat(hs), torch.cat(cs)


def batch_sizes_of(lengths, T):
    return torch.tensor([sum(n > t for n in lengths) for t in range(T)], dtype=torch.int64)


def random_lengths(T, B, gen):
    """B sequence lengths in [0, T], sorted longest first (as a
    PackedSequence holds them), the longest T."""
    lengths = sorted(torch.randint(0, T + 1, (B,), generator=gen).tolist(), reverse=True)
    lengths[0] = T
    return lengths


def packed_case(args, lengths, gen):
    """A packed run's arguments (input zero past each row's length, as
    LLTMSequence pads), requiring grad; their float64 CPU copies; the
    results of rows run alone on those; random incoming gradients (zero on
    the padding of outputs, which nothing reads)."""
    for r, n in enumerate(lengths):
        args[0][n:, r] = 0
    args = [t.requires_grad_() for t in args]
    ref_args = [t.detach().double().cpu().requires_grad_() for t in args]
    ref = packed_reference(ref_args, lengths)
    grads = [torch.randn(r.shape, dtype=torch.float64, generator=gen) for r in ref]
    for r, n in enumerate(lengths):
        grads[0][n:, r] = 0
    return args, ref_args, ref, grads


def assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit):
    """out (backward already run on it) against the rows run alone: values,
    zeros past each row's end, and every argument's gradient."""
    torch.autograd.backward(ref, grads)
    for name, o, r in zip(("outputs", "h_n", "c_n"), out, ref):
        assert rel_err(o.detach().cpu(), r) <= limit, name
    for r, n in enumerate(lengths):
        assert not out[0][n:, r].any(), "outputs past a row's end are zero"
    for name, a, r in zip(("input", "weights", "bias", "old_h", "old_cell"), args, ref_args):
        assert rel_err(a.grad.cpu(), r.grad) <= limit, f"grad of {name}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "lengths,F,S",
    [([5, 3, 3, 1], 4, 6), ([4, 4], 3, 5), ([6, 2, 0], 2, 3), ([1], 3, 8), ([7, 5, 4, 4, 2, 1, 1], 5, 33)],
    ids=str,
)
def test_batch_sizes_run_each_row_for_its_own_length(device, dtype, lengths, F, S):
    """sequence_forward with batch_sizes (sorted lengths, as a PackedSequence
    holds them): every row stops after its own length, its final state is
    that of its last step, nothing past its end is computed into its
    result; the gradients of every argument match rows run alone."""
    need(device)
    T, B = max(lengths), len(lengths)
    gen = torch.Generator().manual_seed(T * 7 + B + S)
    args = make_args(T, B, F, S, dtype=dtype, device=device, generator=gen)
    args, ref_args, ref, grads = packed_case(args, lengths, gen)
    out = run_op(*args, batch_sizes_of(lengths, T))[:3]
    torch.autograd.backward(out, [g.to(device, dtype) for g in grads])
    limit = LIMITS[dtype]
    assert_packed_run_matches(out, args, ref, ref_args, grads, lengths, limit)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_sizes_opcheck(device):
    need(device)
    lengths = [4, 3, 1]
    args = make_args(4, 3, 2, 5, dtype=torch.float64, device=device)
    bs = batch_sizes_of(lengths, 4)
    torch.library.opcheck(seq_forward, (*(t.clone().requires_grad_() for t in args), False, bs))
    outputs, h_n, c_n, gates, cells = seq_forward(*args, False, bs)
    x, w, b, h, c = args
    gs = [torch.randn_like(t) for t in (outputs, h_n, c_n)]
    torch.library.opcheck(seq_backward, (*gs, x, w, h, c, outputs, gates, cells, True, False, bs))


def test_batch_sizes_export():
    """An exported program that calls the op with batch_sizes as an input
    runs other lengths right too (batch_sizes is read by the kernel, not
    baked into the graph)."""

    class Packed(torch.nn.Module):
        def forward(self, x, w, b, h, c, bs):
            return seq_forward(x, w, b, h, c, False, bs)[:3]

    args = make_args(4, 3, 2, 5)
    ep = torch.export.export(Packed(), (*args, batch_sizes_of([4, 2, 1], 4)))
    for lengths in ([4, 2, 1], [3, 3, 0]):
        bs = batch_sizes_of(lengths, 4)
        for got, want in zip(ep.module()(*args, bs), Packed()(*args, bs)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "bs,message",
    [
        (torch.tensor([2, 3, 1]), r"'batch_sizes' must hold non-increasing sizes in \[0, 3\]"),
        (torch.tensor([4, 3, 1]), r"'batch_sizes' must hold non-increasing sizes in \[0, 3\]"),
        (torch.tensor([3, -1, 0]), r"'batch_sizes' must hold non-increasing sizes"),
        (torch.tensor([3, 2]), r"argument 'batch_sizes' must have shape \[3\]"),
        (torch.tensor([3.0, 2.0, 1.0]), r"'batch_sizes' must be an int64 CPU tensor"),
        (torch.tensor([3, 2, 1], dtype=torch.int32), r"'batch_sizes' must be an int64 CPU tensor"),
    ],
    ids=["increasing", "past the batch", "negative", "shape", "float", "int32"],
)
def test_bad_batch_sizes_are_refused(bs, message):
    args = make_args(3, 3, 2, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=rf"lltm_op.sequence_forward: .*{message}"):
        seq_forward(*args, False, bs)
    outputs, h_n, c_n, gates, cells = seq_forward(*args)
    x, w, _, h, c = args
    tensors = (torch.ones_like(outputs), None, None, x, w, h, c, outputs, gates, cells)
    # The kernel and, when an argument requires grad, the torch-op math.
    for differentiable in (False, True):
        with pytest.raises(RuntimeError, match=rf"lltm_op.sequence_backward: .*{message}"):
            seq_backward(*tensors[:4], w.clone().requires_grad_(differentiable), *tensors[5:], True, False, bs)


def test_packed_run_refuses_forward_ad():
    import torch.autograd.forward_ad as fwAD

    args = make_args(3, 2, 2, 4, dtype=torch.float64)
    with fwAD.dual_level():
        x = fwAD.make_dual(args[0], torch.ones_like(args[0]))
        with pytest.raises(RuntimeError, match="forward-mode AD of a packed run"):
            run_op(x, *args[1:], batch_sizes_of([3, 2], 3))
