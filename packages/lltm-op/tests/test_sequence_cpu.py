"""lltm_op.lltm_sequence's two CPU paths for float16/bfloat16: matrix
products in float32 on float32 copies that hold half-type values (the default
on CPUs without bf16/fp16 matrix instructions) and torch's half-type products
(LLTM_OP_SEQUENCE_CPU_FLOAT32=0), each against a float64 loop of pure cells."""

from __future__ import annotations

import pytest
import torch
from lltm_op import lltm_sequence
from test_sequence import env, flat, make_args, reference, rel_err

HALF = [torch.float16, torch.bfloat16]
PATHS = {"float32 products": "1", "half products": "0"}
LIMIT = {torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize(
    ("T", "B", "F", "S", "chunks"),
    [(24, 8, 16, 32, None), (5, 3, 7, 13, 2), (1, 1, 1, 1, None), (7, 2, 0, 9, 3)],
)
def test_half_paths_against_float64(path, dtype, T, B, F, S, chunks):
    """Every output and gradient within the dtype's error of a float64 loop
    of pure cells on the same (rounded) values; odd sizes, F = 0, T = 1 and
    a chunked backward included."""
    gen = torch.Generator().manual_seed(11)
    args = [t.requires_grad_() for t in make_args(T, B, F, S, dtype=dtype, generator=gen)]
    ref_args = [t.detach().double().requires_grad_() for t in args]
    settings = {"LLTM_OP_SEQUENCE_CPU_FLOAT32": PATHS[path]}
    if chunks:
        settings["LLTM_OP_SEQUENCE_CHUNKS"] = chunks
    ref = flat(reference(*ref_args))
    grads = [torch.randn(r.shape, dtype=torch.float64, generator=gen) for r in ref]
    with env(**settings):
        out = flat(lltm_sequence(*args))
        torch.autograd.backward(out, [g.to(dtype) for g in grads])
    torch.autograd.backward(ref, grads)
    limit = LIMIT[dtype]
    for name, o, r in zip(("outputs", "h_n", "c_n"), out, ref):
        assert o.dtype == dtype
        assert rel_err(o, r) <= limit, name
    for name, a, r in zip(("input", "weights", "bias", "old_h", "old_cell"), args, ref_args):
        assert a.grad.dtype == dtype
        assert rel_err(a.grad, r.grad) <= limit, f"grad of {name}"


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_float32_products_round_the_pre_activation_once(dtype):
    """The saved pre-activation G_t is x_t W_x^T + h_{t-1} W_h^T + b (h from
    the op's own outputs) rounded to the dtype once: equal to the float64 sum
    rounded, up to an odd element where float32 accumulation lands on the
    other side of a rounding boundary, and never more than one ulp away."""
    T, B, F, S = 6, 5, 24, 40
    gen = torch.Generator().manual_seed(12)
    x, w, b, h0, c0 = make_args(T, B, F, S, dtype=dtype, generator=gen)
    with env(LLTM_OP_SEQUENCE_CPU_FLOAT32="1"), torch.no_grad():
        outputs, _h_n, _c_n, gates, _cells = torch.ops.lltm_op.sequence_forward(x, w, b, h0, c0)
    h_prev = torch.cat([h0.unsqueeze(0), outputs[:-1]]).double()
    want = torch.cat([h_prev, x.double()], dim=2) @ w.double().t() + b.double()
    rounded = want.to(dtype)
    assert (gates != rounded).double().mean().item() < 0.01
    ulp = (rounded.double().abs() * torch.finfo(dtype).eps).clamp_min(torch.finfo(dtype).tiny)
    assert ((gates.double() - want).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_switch_leaves_float32_and_float64_alone(dtype):
    gen = torch.Generator().manual_seed(13)
    args = make_args(4, 3, 5, 6, dtype=dtype, generator=gen)
    with env(LLTM_OP_SEQUENCE_CPU_FLOAT32="1"):
        one = torch.ops.lltm_op.sequence_forward(*args)
    with env(LLTM_OP_SEQUENCE_CPU_FLOAT32="0"):
        zero = torch.ops.lltm_op.sequence_forward(*args)
    for a, z in zip(one, zero):
        assert torch.equal(a, z)
