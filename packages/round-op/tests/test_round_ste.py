"""round_op.round_ste against the shared op contract, plus its own cases."""

from __future__ import annotations

import pytest
import round_op
import torch
from opscommon.testing import DEVICES, BadInput, OpContract, cuda_usable, run_with_public_api_only
from round_op._runtime import BUILD_INFO

OP = "round_op.round_ste"


def _round_half_up_values(x: torch.Tensor) -> torch.Tensor:
    # + 0.0 turns -0.0 into +0.0, as floor(-0.0 + 0.5) is.
    r = torch.floor(x)
    return torch.where(x - r >= 0.5, r + 1, r) + 0.0


class _ReferenceRoundSTE(torch.autograd.Function):
    """floor(x + 0.5) without forming x + 0.5; the gradient passes through.

    (The composite x + (round(x) - x).detach() would turn inf into NaN.)"""

    @staticmethod
    def forward(ctx, x):
        return _round_half_up_values(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def reference_round_half_up(x: torch.Tensor) -> torch.Tensor:
    return _ReferenceRoundSTE.apply(x)


def composite_round_ste(x: torch.Tensor) -> torch.Tensor:
    """The straight-through estimator in torch ops alone, which forward AD,
    double backward and every torch.func transform differentiate (finite
    inputs: x - x is NaN at infinity)."""
    return x + (_round_half_up_values(x) - x).detach()


class TestRoundSteContract(OpContract):
    op_name = OP
    build_info = BUILD_INFO
    cases = [(), (0,), (1,), (7,), (1000,), (3, 5, 7), (2, 0, 3), (33, 65), (4097,)]
    grad_cases = [(5,), (3, 4)]
    numerically_differentiable = False

    def make_inputs(self, case, dtype, device):
        # Values around the .5 boundaries, negatives, and large magnitudes.
        x = torch.randn(case, dtype=torch.float64, device=device) * 4
        return (x.to(dtype),)

    def call(self, x):
        return round_op.round_ste(x)

    def make_module(self, case, dtype, device):
        return round_op.RoundSTE(), self.make_inputs(case, dtype, device)

    def reference(self, x):
        return reference_round_half_up(x)

    def derivative_reference(self, x):
        return composite_round_ste(x)

    def opcheck_targets(self):
        return [torch.ops.round_op.round_ste.default]

    def tolerance(self, dtype):
        return {"rtol": 0, "atol": 0}  # integers: exact

    def bad_inputs(self, device):
        return [
            BadInput(
                "int32 input",
                lambda: round_op.round_ste(torch.ones(3, dtype=torch.int32, device=device)),
                f"{OP}: argument 'x' must be a floating-point tensor",
            ),
            BadInput(
                "bool input",
                lambda: round_op.round_ste(torch.ones(3, dtype=torch.bool, device=device)),
                f"{OP}: argument 'x' must be a floating-point tensor",
            ),
            BadInput(
                "int64 via torch.ops",
                lambda: torch.ops.round_op.round_ste(torch.ones(3, dtype=torch.int64, device=device)),
                f"{OP}: argument 'x' must be a floating-point tensor.*int64",
            ),
            BadInput("None", lambda: round_op.round_ste(None), f"{OP}: argument 'x' must be a tensor", TypeError),
        ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_half_up_at_the_boundaries(device, dtype):
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    values = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.25, 0.75, 0.0, -0.0, 3.0, -3.0]
    expect = [1.0, 2.0, 3.0, 0.0, -1.0, -2.0, 0.0, 1.0, 0.0, 0.0, 3.0, -3.0]
    x = torch.tensor(values, dtype=dtype, device=device)
    torch.testing.assert_close(round_op.round_ste(x), torch.tensor(expect, dtype=dtype, device=device))


def exact_round_half_up(x: torch.Tensor) -> torch.Tensor:
    """floor(x + 0.5) of float16/bfloat16/float32 values, computed in float64
    (x + 0.5 is exact there for float16; for the others, where it is not,
    the rounded sum has the same floor), back in x's dtype. -0.0 + 0.5 is
    0.5, so the zero of the result is +0.0."""
    return torch.floor(x.double() + 0.5).to(x.dtype)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit (the sign of zero included), NaN anywhere NaN."""
    assert torch.equal(got.isnan(), want.isnan())
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    keep = ~want.isnan()
    mismatch = (got.view(bits) != want.view(bits)) & keep
    assert not mismatch.any(), (got[mismatch][:8], want[mismatch][:8])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_half_precision_bit_pattern(device, dtype):
    """All 65536 values of the dtype (zeros, subnormals, the largest finite
    values, infinities, NaNs) against the exact definition, bit for bit."""
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).to(device)
    assert_same_bits(round_op.round_ste(x).cpu(), exact_round_half_up(x.cpu()))


@pytest.mark.parametrize("device", DEVICES)
def test_float32_random_bit_patterns(device):
    """2^20 random float32 bit patterns, and every value near +-0.5, +-1.5."""
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), dtype=torch.int64).to(torch.int32)
    near = torch.tensor([-1.5, -0.5, 0.5, 1.5]).view(torch.int32)
    near = (near[:, None] + torch.arange(-64, 65, dtype=torch.int32)).flatten()
    x = torch.cat([bits, near]).view(torch.float32).to(device)
    assert_same_bits(round_op.round_ste(x).cpu(), exact_round_half_up(x.cpu()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_negative_zero_rounds_to_positive_zero(device, dtype):
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    x = torch.tensor([-0.0, 0.0, -0.25, -0.5, -0.49, 0.25], dtype=dtype, device=device)
    out = round_op.round_ste(x)
    assert torch.equal(out, torch.zeros_like(out)) and not out.signbit().any()


@pytest.mark.parametrize("device", DEVICES)
def test_allocation_failure_names_the_op_and_size(device):
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    huge = torch.zeros(1, device=device).expand(2**50)  # 4 PiB once materialized
    with pytest.raises(
        RuntimeError,
        match=rf"^{OP}: could not allocate an output, a float32 tensor of "
        r"shape \[1125899906842624\] \(4503599627370496 bytes\) on (cpu|cuda:\d+) "
        r"\(out of memory\?\)$",
    ):
        round_op.round_ste(huge)


@pytest.mark.parametrize("device", DEVICES)
def test_just_below_half_does_not_round_up(device):
    # 0.49999997f + 0.5f rounds to 1.0f in float32: the op must still say 0.
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    below = torch.nextafter(torch.tensor(0.5), torch.tensor(0.0)).to(device)
    assert (below + 0.5).item() == 1.0  # the trap is real
    assert round_op.round_ste(below).item() == 0.0
    big = torch.tensor([2.0**23 + 1, -(2.0**23) - 1, 2.0**24], device=device)
    torch.testing.assert_close(round_op.round_ste(big), big)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_pass_through(device):
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    x = torch.tensor([float("nan"), float("inf"), -float("inf")], device=device)
    torch.testing.assert_close(round_op.round_ste(x), x, equal_nan=True)


def test_backward_passes_gradient_through_unchanged():
    x = torch.rand(10, requires_grad=True)
    g = torch.randn(10)
    round_op.round_ste(x).backward(g)
    assert torch.equal(x.grad, g)


def test_fast_path_uses_private_api_with_public_fallback():
    from round_op import _runtime, ops

    # In this process: the fast route (torch's private API, present here).
    assert _runtime.using_private_api()
    assert ops._round_ste_below_autograd.uses_private_api
    # A torch without those names: the public fallbacks, same results.
    run_with_public_api_only(
        """
import torch
import torch.autograd.forward_ad as fwAD
import round_op
from round_op import _runtime, ops
assert not _runtime.using_private_api()
assert not ops._round_ste_below_autograd.uses_private_api
assert ops._apply == ops._RoundSTEFunction.apply
x = torch.tensor([0.5, 1.5, -0.5, 2.49, -2.5])
want = torch.floor(x + 0.5)
assert torch.equal(round_op.round_ste(x), want)
xg = x.clone().requires_grad_()
y = round_op.round_ste(xg)
assert torch.equal(y, want)
y.backward(torch.arange(5.0))
assert torch.equal(xg.grad, torch.arange(5.0))
with fwAD.dual_level():
    out = fwAD.unpack_dual(round_op.round_ste(fwAD.make_dual(x, torch.ones(5))))
assert torch.equal(out.primal, want) and torch.equal(out.tangent, torch.ones(5))
g = torch.func.grad(lambda t: round_op.round_ste(t).sum())(x)
assert torch.equal(g, torch.ones(5))
"""
    )


def test_module_wrapper():
    m = round_op.RoundSTE()
    x = torch.rand(4, 4)
    torch.testing.assert_close(m(x), reference_round_half_up(x))


def test_cpu_only_build_rejects_cuda_clearly():
    if BUILD_INFO.get("cuda") is not None or not torch.cuda.is_available():
        pytest.skip("only for a CPU-only build in a CUDA torch")
    with pytest.raises(RuntimeError, match="CPU-only build"):
        round_op.round_ste(torch.ones(2, device="cuda"))


@pytest.mark.cuda
def test_more_than_2_31_elements_on_gpu():
    if not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    n = 2**31 + 77  # odd: exercises the vector body past 2^31 and the scalar tail
    if torch.cuda.mem_get_info()[0] < 3 * n * 2:
        pytest.skip("not enough GPU memory")
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").uniform_(-4, 4)
    out = round_op.round_ste(x)
    picks = torch.cat(
        [
            torch.arange(1000, device="cuda"),
            torch.arange(n - 1000, n, device="cuda"),
            torch.randint(0, n, (100_000,), device="cuda"),
        ]
    )
    torch.testing.assert_close(out[picks], reference_round_half_up(x[picks]), rtol=0, atol=0)
    del x, out
    torch.cuda.empty_cache()
