"""round_op.round_ste against the shared op contract, plus its own cases."""

from __future__ import annotations

import pytest
import torch

import round_op
from opscommon.testing import DEVICES, BadInput, OpContract, cuda_usable
from round_op._runtime import BUILD_INFO

OP = "round_op.round_ste"


class _ReferenceRoundSTE(torch.autograd.Function):
    """floor(x + 0.5) without forming x + 0.5; the gradient passes through.

    (The composite x + (round(x) - x).detach() would turn inf into NaN.)"""

    @staticmethod
    def forward(ctx, x):
        r = torch.floor(x)
        return torch.where(x - r >= 0.5, r + 1, r)

    @staticmethod
    def backward(ctx, grad):
        return grad


def reference_round_half_up(x: torch.Tensor) -> torch.Tensor:
    return _ReferenceRoundSTE.apply(x)


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

    def reference(self, x):
        return reference_round_half_up(x)

    def opcheck_targets(self):
        return [torch.ops.round_op.round_ste.default]

    def tolerance(self, dtype):
        return {"rtol": 0, "atol": 0}  # integers: exact

    def bad_inputs(self, device):
        return [
            BadInput("int32 input", lambda: round_op.round_ste(torch.ones(3, dtype=torch.int32, device=device)),
                     f"{OP}: argument 'x' must be a floating-point tensor"),
            BadInput("bool input", lambda: round_op.round_ste(torch.ones(3, dtype=torch.bool, device=device)),
                     f"{OP}: argument 'x' must be a floating-point tensor"),
            BadInput("int64 via torch.ops", lambda: torch.ops.round_op.round_ste(torch.ones(3, dtype=torch.int64, device=device)),
                     f"{OP}: argument 'x' must be a floating-point tensor.*int64"),
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
    picks = torch.cat([torch.arange(1000, device="cuda"), torch.arange(n - 1000, n, device="cuda"),
                       torch.randint(0, n, (100_000,), device="cuda")])
    torch.testing.assert_close(out[picks], reference_round_half_up(x[picks]), rtol=0, atol=0)
    del x, out
    torch.cuda.empty_cache()
