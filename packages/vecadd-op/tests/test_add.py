"""vecadd_op.add against the shared op contract, plus out=, aliasing and the
cases of its own."""

from __future__ import annotations

import re

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import vecadd_op
from opscommon.testing import (
    DEVICES,
    LAYOUTS,
    BadInput,
    OpContract,
    cuda_usable,
    run_with_public_api_only,
    with_layout,
)
from vecadd_op._runtime import BUILD_INFO

OP = "vecadd_op.add"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def needs_device(device: str) -> str:
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    return device


def rand(shape, dtype, device, low=-1000, high=1000):
    if dtype.is_floating_point:
        return (torch.randn(shape, dtype=torch.float64, device=device) * 10).to(dtype)
    return torch.randint(low, high, shape, dtype=dtype, device=device)


def message(text: str) -> str:
    """A pytest.raises(match=...) pattern for this exact message text."""
    return re.escape(text)


class TestAddContract(OpContract):
    op_name = OP
    build_info = BUILD_INFO
    dtypes = vecadd_op.DTYPES  # float16, bfloat16, float32, float64, int32, int64
    # (), empty, odd sizes around the 16-byte vector width, and sizes above
    # the CPU threading grain (32768).
    cases = [(), (0,), (1,), (7,), (17,), (1000,), (3, 5, 7), (2, 0, 3), (33, 65), (4097,), (257, 513), (100_003,)]
    grad_cases = [(5,), (3, 4)]
    grad_inputs = (0, 1)

    def make_inputs(self, case, dtype, device):
        return rand(case, dtype, device), rand(case, dtype, device)

    def call(self, a, b):
        return vecadd_op.add(a, b)

    def make_module(self, case, dtype, device):
        return vecadd_op.VecAdd(), self.make_inputs(case, dtype, device)

    def reference(self, a, b):
        return torch.add(a, b)

    def opcheck_targets(self):
        # add.out is opchecked in test_opcheck_out below: it needs out= as a
        # keyword argument, which the contract does not pass.
        return [torch.ops.vecadd_op.add.default]

    def tolerance(self, dtype):
        # One rounding of the exact sum (half types add in float, as torch
        # does): bit-identical to torch.add.
        return {"rtol": 0, "atol": 0}

    def bad_inputs(self, device):
        f32 = dict(device=device)
        a, b = torch.ones(2, 3, **f32), torch.ones(2, 3, **f32)
        out = torch.empty(2, 3, **f32)
        cases = [
            BadInput(
                "shape mismatch",
                lambda: vecadd_op.add(a, torch.ones(3, **f32)),
                message(f"{OP}: arguments 'a' and 'b' must have the same shape, got [2, 3] and [3]"),
            ),
            BadInput(
                "no broadcasting of 0-dim",
                lambda: vecadd_op.add(torch.ones((), **f32), b),
                message(f"{OP}: arguments 'a' and 'b' must have the same shape, got [] and [2, 3]"),
            ),
            BadInput(
                "dtype mismatch",
                lambda: vecadd_op.add(a, b.double()),
                message(f"{OP}: arguments 'a' and 'b' must have the same dtype, got float32 and float64"),
            ),
            BadInput(
                "int32 + int64",
                lambda: vecadd_op.add(a.int(), b.long()),
                message(f"{OP}: arguments 'a' and 'b' must have the same dtype, got int32 and int64"),
            ),
            BadInput(
                "bool",
                lambda: vecadd_op.add(a.bool(), b.bool()),
                message(
                    f"{OP}: argument 'a' has dtype bool; supported dtypes are float16, "
                    "bfloat16, float32, float64, int32, int64"
                ),
            ),
            BadInput(
                "uint8",
                lambda: vecadd_op.add(a.to(torch.uint8), b.to(torch.uint8)),
                message(f"{OP}: argument 'a' has dtype uint8; supported"),
            ),
            BadInput(
                "a None",
                lambda: vecadd_op.add(None, b),
                message(f"{OP}: argument 'a' must be a tensor, got NoneType"),
                TypeError,
            ),
            BadInput(
                "b a float",
                lambda: vecadd_op.add(a, 1.0),
                message(f"{OP}: argument 'b' must be a tensor, got float"),
                TypeError,
            ),
            BadInput(
                "out a list",
                lambda: vecadd_op.add(a, b, out=[1]),
                message(f"{OP}: argument 'out' must be a tensor, got list"),
                TypeError,
            ),
            BadInput(
                "out wrong shape",
                lambda: vecadd_op.add(a, b, out=torch.empty(6, **f32)),
                message(
                    f"{OP}: argument 'out' must have the shape of 'a' and 'b' ([2, 3]), got [6] (out= is never resized)"
                ),
            ),
            BadInput(
                "out empty",
                lambda: vecadd_op.add(a, b, out=torch.empty(0, **f32)),
                message(f"{OP}: argument 'out' must have the shape of 'a' and 'b' ([2, 3]), got [0]"),
            ),
            BadInput(
                "out wrong dtype",
                lambda: vecadd_op.add(a, b, out=out.half()),
                message(f"{OP}: argument 'out' must have the dtype of 'a' and 'b' (float32), got float16"),
            ),
            BadInput(
                "out expanded",
                lambda: vecadd_op.add(a, b, out=torch.empty(1, 3, **f32).expand(2, 3)),
                message(f"{OP}: argument 'out' has elements that share memory (dimension 0 has stride 0"),
            ),
            BadInput(
                "out requires grad",
                lambda: vecadd_op.add(a, b, out=torch.empty(2, 3, requires_grad=True, **f32)),
                message(f"{OP}: argument 'out' requires grad, but out= does not support automatic differentiation"),
            ),
            BadInput(
                "a requires grad with out=",
                lambda: vecadd_op.add(a.clone().requires_grad_(), b, out=out),
                message(f"{OP}: argument 'a' requires grad, but out= does not support"),
            ),
            # The registered ops check the same things themselves.
            BadInput(
                "torch.ops shape",
                lambda: torch.ops.vecadd_op.add(a, torch.ones(3, 2, **f32)),
                message(f"{OP}: arguments 'a' and 'b' must have the same shape, got [2, 3] and [3, 2]"),
            ),
            BadInput(
                "torch.ops dtype",
                lambda: torch.ops.vecadd_op.add.default(a.bool(), b),
                message(f"{OP}: argument 'a' has dtype bool"),
            ),
            BadInput(
                "torch.ops out shape",
                lambda: torch.ops.vecadd_op.add.out(a, b, out=torch.empty(3, 2, **f32)),
                message(f"{OP}: argument 'out' must have the shape of 'a' and 'b' ([2, 3]), got [3, 2]"),
            ),
            BadInput(
                "torch.ops out requires grad",
                lambda: torch.ops.vecadd_op.add.out(a, b, out=torch.zeros(2, 3, requires_grad=True, **f32)),
                message(f"{OP}: argument 'out' requires grad"),
            ),
        ]
        if device == "cuda":
            cases += [
                BadInput(
                    "a cpu, b cuda",
                    lambda: vecadd_op.add(a.cpu(), b),
                    message(f"{OP}: arguments 'a' and 'b' must be on the same device, got cpu and cuda:0"),
                ),
                BadInput(
                    "out on cpu",
                    lambda: vecadd_op.add(a, b, out=out.cpu()),
                    message(f"{OP}: argument 'out' must be on the device of 'a' and 'b' (cuda:0), got cpu"),
                ),
            ]
        elif cuda_usable(BUILD_INFO):
            cases += [
                BadInput(
                    "out on cuda",
                    lambda: vecadd_op.add(a, b, out=out.cuda()),
                    message(f"{OP}: argument 'out' must be on the device of 'a' and 'b' (cpu), got cuda:0"),
                ),
            ]
        return cases


# -- out= -----------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_any_layout_gets_the_values(device, layout):
    device = needs_device(device)
    for dtype in vecadd_op.DTYPES:
        for shape in [(), (0,), (5,), (33, 65), (4, 1, 9)]:
            a, b = rand(shape, dtype, device), rand(shape, dtype, device)
            out = with_layout(torch.zeros(shape, dtype=dtype, device=device), layout)
            strides = out.stride()
            result = vecadd_op.add(a, b, out=out)
            assert result is out
            assert out.stride() == strides  # written in place, not replaced
            torch.testing.assert_close(out, a + b, rtol=0, atol=0)
            # Also through the registered op, and with laid-out inputs.
            out2 = with_layout(torch.zeros(shape, dtype=dtype, device=device), layout)
            torch.ops.vecadd_op.add.out(with_layout(a, layout), with_layout(b, layout), out=out2)
            torch.testing.assert_close(out2, a + b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_rejected_out_is_left_unchanged(device):
    device = needs_device(device)
    a, b = torch.rand(4, 5, device=device), torch.rand(4, 5, device=device)
    bad_outs = {
        "wrong shape": torch.full((5, 4), 7.0, device=device),
        "wrong dtype": torch.full((4, 5), 7.0, dtype=torch.float64, device=device),
        "expanded": torch.full((1, 5), 7.0, device=device).expand(4, 5),
        "requires grad": torch.full((4, 5), 7.0, device=device, requires_grad=True),
    }
    for name, out in bad_outs.items():
        before = out.detach().clone()
        with pytest.raises(RuntimeError, match=f"{OP}: argument 'out'"):
            vecadd_op.add(a, b, out=out)
        assert torch.equal(out.detach(), before), name
    # Bad inputs with a good out: out untouched too.
    out = torch.full((4, 5), 7.0, device=device)
    for a_, b_ in [(a, torch.rand(5, 4, device=device)), (a, b.double()), (a.requires_grad_(), b)]:
        with pytest.raises(RuntimeError, match=OP):
            vecadd_op.add(a_, b_, out=out)
        assert torch.equal(out, torch.full((4, 5), 7.0, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_out_that_requires_grad_is_fine_under_no_grad(device):
    # Like torch.add(..., out=p) in an optimizer step: allowed without grad mode.
    device = needs_device(device)
    p = torch.rand(6, device=device, requires_grad=True)
    step = torch.rand(6, device=device)
    expect = p.detach() + step
    with torch.no_grad():
        vecadd_op.add(p, step, out=p)
    torch.testing.assert_close(p.detach(), expect, rtol=0, atol=0)


def test_out_bumps_the_version_counter():
    # As aten's out= ops do: autograd must notice a saved tensor overwritten.
    a, b, c = torch.rand(3), torch.rand(3), torch.empty(3)
    v = c._version
    vecadd_op.add(a, b, out=c)
    assert c._version > v
    v = c._version
    torch.ops.vecadd_op.add.out(a, b, out=c)
    assert c._version > v
    x = torch.rand(3, requires_grad=True)
    y = x.sigmoid()  # saves y for backward
    with torch.no_grad():
        vecadd_op.add(a, b, out=y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_out_inference_tensor_refused_outside_inference_mode(device):
    # As torch.add(a, b, out=o) refuses, and before anything is written.
    device = needs_device(device)
    a, b = torch.rand(4, 5, device=device), torch.rand(4, 5, device=device)
    with torch.inference_mode():
        o = torch.full((4, 5), 7.0, device=device)
        ai, bi = a.clone(), b.clone()
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        torch.add(a, b, out=o)
    with torch.inference_mode():
        o.fill_(7.0)  # (torch.add raises after writing)
    for add in (vecadd_op.add, torch.ops.vecadd_op.add.out, torch.ops.vecadd_op.add):
        for x, y in ((a, b), (ai, bi), (a, bi)):
            with pytest.raises(
                RuntimeError,
                match=f"^{OP}: argument 'out' is an inference tensor: Inplace "
                "update to inference tensor outside InferenceMode is not allowed",
            ):
                add(x, y, out=o)
            assert torch.equal(o, torch.full((4, 5), 7.0, device=device))
    with torch.inference_mode():  # inside inference mode: allowed, as for torch.add
        assert vecadd_op.add(a, b, out=o) is o
        torch.testing.assert_close(o, a + b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_out_refuses_forward_ad_and_vmap(device):
    # out= has no derivative (as torch.add(..., out=)): dual tensors and
    # torch.func.jvp / vmap are refused with the op's name, never a dropped tangent.
    device = needs_device(device)
    a, b, t = (torch.rand(3, device=device, dtype=torch.float64) for _ in range(3))
    for add in (vecadd_op.add, torch.ops.vecadd_op.add.out):
        out = torch.zeros(3, device=device, dtype=torch.float64)
        with fwAD.dual_level():
            for args in ((fwAD.make_dual(a, t), b), (a, fwAD.make_dual(b, t))):
                with pytest.raises(
                    RuntimeError,
                    match=f"^{OP}: argument '[ab]' has a forward-mode AD tangent, "
                    "but out= does not support forward-mode automatic differentiation",
                ):
                    add(*args, out=out)
        assert torch.equal(out, torch.zeros_like(out))
        with pytest.raises(RuntimeError, match=f"^{OP}: argument 'a' has a forward-mode AD tangent"):
            torch.func.jvp(lambda x: add(x, b, out=torch.zeros_like(b)), (a,), (t,))
        with pytest.raises(RuntimeError, match="vecadd_op::add.out"):
            torch.func.vmap(lambda x: add(x, b[0], out=torch.zeros_like(b[0])))(a)
        # Without tangents a dual level changes nothing.
        with fwAD.dual_level():
            assert add(a, b, out=out) is out
        torch.testing.assert_close(out, a + b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_allocation_failure_names_the_op_and_size(device):
    device = needs_device(device)
    huge = torch.zeros(1, device=device).expand(2**50)  # 4 PiB once materialized
    with pytest.raises(
        RuntimeError,
        match=f"^{OP}: could not allocate an output, a float32 tensor of shape "
        + message("[1125899906842624] (4503599627370496 bytes) on ")
        + r"(cpu|cuda:\d+) "
        + message("(out of memory?)")
        + "$",
    ):
        vecadd_op.add(huge, huge)


# -- aliasing -------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_aliasing(device, dtype):
    device = needs_device(device)
    for n in [1, 7, 1000, 100_003]:
        a0, b0 = rand((n,), dtype, device), rand((n,), dtype, device)
        a, b = a0.clone(), b0.clone()
        torch.testing.assert_close(vecadd_op.add(a, a), a0 + a0, rtol=0, atol=0)
        assert vecadd_op.add(a, b, out=a) is a
        torch.testing.assert_close(a, a0 + b0, rtol=0, atol=0)
        a = a0.clone()
        vecadd_op.add(a, b, out=b)
        torch.testing.assert_close(b, a0 + b0, rtol=0, atol=0)
        vecadd_op.add(a, a, out=a)
        torch.testing.assert_close(a, a0 + a0, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_out_partly_overlapping_an_input(device):
    # out shifted against an input by one element (and, on the GPU, by a
    # misaligned amount): the result is a + b of the values before the call.
    device = needs_device(device)
    for n in [10, 4099, 100_003]:
        y = torch.rand(n - 1, device=device)
        x = torch.rand(n, device=device)
        expect = x[:-1] + y
        vecadd_op.add(x[:-1], y, out=x[1:])
        torch.testing.assert_close(x[1:], expect, rtol=0, atol=0)
        x = torch.rand(n, device=device)
        expect = x[1:] + y
        vecadd_op.add(x[1:], y, out=x[:-1])
        torch.testing.assert_close(x[:-1], expect, rtol=0, atol=0)
    # Same memory, other layout: out is the transpose of the input.
    a = torch.rand(33, 33, device=device)
    b = torch.rand(33, 33, device=device)
    expect = a + b
    vecadd_op.add(a, b, out=a.t())
    torch.testing.assert_close(a.t(), expect, rtol=0, atol=0)


# -- values ---------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_mixed_alignment_inputs(device):
    # One input 16-byte aligned, the other not (scalar path), and the reverse,
    # at sizes around the vector width.
    device = needs_device(device)
    for dtype in vecadd_op.DTYPES:
        for n in [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 1023, 1025]:
            a, b = rand((n,), dtype, device), rand((n,), dtype, device)
            a_off = with_layout(a, "offset")
            torch.testing.assert_close(vecadd_op.add(a_off, b), a + b, rtol=0, atol=0)
            torch.testing.assert_close(vecadd_op.add(b, a_off), b + a, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_integers_wrap_around_like_torch(device):
    device = needs_device(device)
    for dtype in (torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        a = torch.tensor([info.max, info.min, info.max, -1] * 5, dtype=dtype, device=device)
        b = torch.tensor([1, -1, info.max, 1] * 5, dtype=dtype, device=device)
        assert torch.equal(vecadd_op.add(a, b), a + b)


@pytest.mark.parametrize("device", DEVICES)
def test_special_values(device):
    device = needs_device(device)
    for dtype in FLOAT_DTYPES:
        inf, nan = float("inf"), float("nan")
        a = torch.tensor([inf, -inf, nan, inf, 1.0, -0.0], dtype=dtype, device=device)
        b = torch.tensor([1.0, 1.0, 1.0, -inf, nan, -0.0], dtype=dtype, device=device)
        torch.testing.assert_close(vecadd_op.add(a, b), a + b, equal_nan=True, rtol=0, atol=0)
        big = torch.tensor([torch.finfo(dtype).max] * 3, dtype=dtype, device=device)
        torch.testing.assert_close(vecadd_op.add(big, big), big + big, rtol=0, atol=0)  # overflow to inf


# -- autograd -------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_gradient_flows_to_both_inputs(device):
    device = needs_device(device)
    a = torch.rand(3, 4, device=device, requires_grad=True)
    b = torch.rand(3, 4, device=device, requires_grad=True)
    g = torch.randn(3, 4, device=device)
    vecadd_op.add(a, b).backward(g)
    assert torch.equal(a.grad, g) and torch.equal(b.grad, g)
    # Same tensor twice: the gradients add up.
    a.grad = None
    vecadd_op.add(a, a).backward(g)
    torch.testing.assert_close(a.grad, 2 * g)
    # Only one input requires grad.
    c = torch.rand(3, 4, device=device)
    a.grad = None
    out = vecadd_op.add(c, a)
    assert out.requires_grad
    out.backward(g)
    assert torch.equal(a.grad, g)


@pytest.mark.parametrize("device", DEVICES)
def test_no_graph_without_grad(device):
    device = needs_device(device)
    a = torch.rand(5, device=device, requires_grad=True)
    with torch.no_grad():
        assert not vecadd_op.add(a, a).requires_grad
    with torch.inference_mode():
        assert torch.equal(vecadd_op.add(a, a), 2 * a.detach())
    i = torch.arange(5, device=device)
    assert not vecadd_op.add(i, i).requires_grad


# -- opcheck, compile, vmap -------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_out(device):
    # test_aot_dispatch_dynamic is left out: PyTorch cannot functionalize a
    # custom op whose return aliases an input (Tensor(a!)) unless the schema
    # is tagged torch.Tag.out, which the stable ABI can set only from torch
    # 2.12 on. add(..., out=) under torch.compile goes another way (below).
    device = needs_device(device)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    for dtype in (torch.float32, torch.float64, torch.int32):
        for shape in [(5,), (3, 4), ()]:
            a, b = rand(shape, dtype, device), rand(shape, dtype, device)
            for out in (
                torch.empty(shape, dtype=dtype, device=device),
                with_layout(torch.empty(shape, dtype=dtype, device=device), "transposed"),
            ):
                torch.library.opcheck(torch.ops.vecadd_op.add.out, (a, b), {"out": out}, test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_out_fullgraph(device):
    device = needs_device(device)
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, dynamic=False)
    def f(a, b, c):
        return vecadd_op.add(a, b, out=c)

    a, b = torch.rand(3, 4, device=device), torch.rand(3, 4, device=device)
    c = torch.zeros(3, 4, device=device)
    assert f(a, b, c) is c
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)
    x = torch.rand(12, device=device)
    y = torch.rand(11, device=device)
    expect = x[:-1] + y
    f(x[:-1], y, x[1:])
    torch.testing.assert_close(x[1:], expect, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_raises_the_eager_errors(device):
    device = needs_device(device)
    torch._dynamo.reset()
    add = torch.compile(vecadd_op.add, fullgraph=True, dynamic=False)
    a = torch.rand(2, 3, device=device)
    with pytest.raises(
        RuntimeError, match=message(f"{OP}: arguments 'a' and 'b' must have the same shape, got [2, 3] and [3]")
    ):
        add(a, torch.rand(3, device=device))
    with pytest.raises(
        RuntimeError, match=message(f"{OP}: arguments 'a' and 'b' must have the same dtype, got float32 and float64")
    ):
        add(a, a.double())
    out = torch.full((3, 2), 5.0, device=device)
    with pytest.raises(
        RuntimeError, match=message(f"{OP}: argument 'out' must have the shape of 'a' and 'b' ([2, 3]), got [3, 2]")
    ):
        add(a, a, out=out)
    assert torch.equal(out, torch.full((3, 2), 5.0, device=device))
    with pytest.raises(RuntimeError, match=f"{OP}: argument 'a' requires grad"):
        add(a.clone().requires_grad_(), a, out=torch.empty(2, 3, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_vmap(device):
    device = needs_device(device)
    x, y = torch.rand(4, 3, device=device), torch.rand(3, device=device)
    torch.testing.assert_close(torch.func.vmap(vecadd_op.add)(x, x), x + x)
    torch.testing.assert_close(torch.func.vmap(vecadd_op.add, in_dims=(0, None))(x, y), x + y)
    torch.testing.assert_close(torch.func.vmap(vecadd_op.add, in_dims=(1, None))(x.t(), y), x + y)
    # Gradients through vmap still reach the inputs.
    xg = x.clone().requires_grad_()
    torch.func.vmap(vecadd_op.add)(xg, x).sum().backward()
    assert torch.equal(xg.grad, torch.ones_like(x))


def test_export():
    ep = torch.export.export(vecadd_op.VecAdd(), (torch.rand(3, 4), torch.rand(3, 4)))
    assert any(n.target is torch.ops.vecadd_op.add.default for n in ep.graph.nodes)
    a, b = torch.rand(3, 4), torch.rand(3, 4)
    torch.testing.assert_close(ep.module()(a, b), a + b, rtol=0, atol=0)


def test_module_wrapper():
    m = vecadd_op.VecAdd()
    a, b = torch.rand(4, 4), torch.rand(4, 4)
    torch.testing.assert_close(m(a, b), a + b, rtol=0, atol=0)
    assert isinstance(m, torch.nn.Module)


def test_cpu_only_build_rejects_cuda_clearly():
    if BUILD_INFO.get("cuda") is not None or not torch.cuda.is_available():
        pytest.skip("only for a CPU-only build in a CUDA torch")
    with pytest.raises(RuntimeError, match="CPU-only build"):
        vecadd_op.add(torch.ones(2, device="cuda"), torch.ones(2, device="cuda"))


# -- CUDA only --------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_current_stream_and_graph_capture():
    needs_device("cuda")
    a, b = torch.rand(1 << 20, device="cuda"), torch.rand(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            r = vecadd_op.add(a, b)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(r, a + b, rtol=0, atol=0)
    # CUDA graph: the kernel must launch on the capturing stream.
    out = torch.empty_like(a)
    vecadd_op.add(a, b, out=out)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        vecadd_op.add(a, b, out=out)
    a.copy_(torch.rand_like(a))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, a + b, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_other_device():
    needs_device("cuda")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    a = torch.rand(1000, device="cuda:1")
    torch.testing.assert_close(vecadd_op.add(a, a), a + a, rtol=0, atol=0)
    with pytest.raises(
        RuntimeError, match=message(f"{OP}: arguments 'a' and 'b' must be on the same device, got cuda:1 and cuda:0")
    ):
        vecadd_op.add(a, a.to("cuda:0"))


@pytest.mark.cuda
def test_cuda_more_than_2_to_the_31_elements():
    # 64-bit indexing: bfloat16, 2^31 + 7 elements, a, b and the result
    # (about 12.9 GB) plus a 2.1 GB mask.
    needs_device("cuda")
    n = (1 << 31) + 7
    need = 3 * n * 2 + n + (1 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    a = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    b = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    # Distinct values past 2^31, where a 32-bit index would wrap around.
    marks = torch.tensor([0, 1, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, n - 1], device="cuda")
    a[marks] = torch.arange(2, 8, dtype=torch.bfloat16, device="cuda")
    r = vecadd_op.add(a, b)
    assert r.shape == (n,)
    assert torch.equal(r[marks].float().cpu(), torch.arange(3, 9, dtype=torch.float32))
    mask = r != 1
    assert int(mask.sum()) == len(marks)
    del mask, r
    # out= on the same size, written in place.
    vecadd_op.add(a, b, out=a)
    assert torch.equal(a[marks].float().cpu(), torch.arange(3, 9, dtype=torch.float32))
    assert float(a[(1 << 31) + 5]) == 1.0


def test_fast_path_uses_private_api_with_public_fallback():
    from vecadd_op import _runtime, ops

    # In this process: the fast route (torch's private API, present here).
    assert _runtime.using_private_api()
    assert ops._add_below_autograd.uses_private_api and ops._add_out_raw is not ops._add_out
    # A torch without those names: the public fallbacks, same results.
    run_with_public_api_only(
        """
import torch
import torch.autograd.forward_ad as fwAD
import vecadd_op
from vecadd_op import _runtime, ops
assert not _runtime.using_private_api()
assert not ops._add_below_autograd.uses_private_api and ops._add_out_raw is ops._add_out
assert ops._apply == ops._AddFunction.apply
a, b = torch.rand(7), torch.rand(7)
assert torch.equal(vecadd_op.add(a, b), a + b)
out = torch.empty(7)
v = out._version
assert vecadd_op.add(a, b, out=out) is out and torch.equal(out, a + b) and out._version > v
ag, bg = a.clone().requires_grad_(), b.clone().requires_grad_()
vecadd_op.add(ag, bg).backward(torch.arange(7.0))
assert torch.equal(ag.grad, torch.arange(7.0)) and torch.equal(bg.grad, torch.arange(7.0))
with fwAD.dual_level():
    res = fwAD.unpack_dual(vecadd_op.add(fwAD.make_dual(a, torch.ones(7)), b))
assert torch.equal(res.primal, a + b) and torch.equal(res.tangent, torch.ones(7))
g = torch.func.grad(lambda t: vecadd_op.add(t, b).sum())(a)
assert torch.equal(g, torch.ones(7))
"""
    )
