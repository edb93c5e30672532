"""Deployment: a layer calling round_op.round_ste, exported with a dynamic
batch, compiled by AOTInductor into a .pt2, then run in a fresh Python that
imports only torch and round_op, and by the C++ runner with no Python in its
process (opscommon.deploy). Outputs must equal eager's."""

from __future__ import annotations

import pytest
import round_op
import torch
from opscommon.testing import DeployContract
from round_op._runtime import BUILD_INFO
from torch import nn

MODULE = "round_op"


class Model(nn.Module):
    """Quantize the input to quarter steps with the straight-through round,
    then a linear layer: the rounding sees the input itself, so eager and
    compiled round the very same values."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(round_op.round_ste(x * 4.0) / 4.0)


# What the export sees, and the inputs the deployed package is checked on
# (other sizes: the batch is dynamic). scripts/deploy_across.py uses them too.
DYNAMIC_SHAPES = ({0: torch.export.Dim("batch", min=1, max=1 << 16)},)


def example_inputs(device: str) -> tuple[torch.Tensor, ...]:
    return (torch.randn(5, 8, device=device),)


def _inputs(device: str, batch: int) -> list[torch.Tensor]:
    return [torch.randn(batch, 8, device=device) * 3]


def sample_inputs(device: str) -> list[list[torch.Tensor]]:
    return [_inputs(device, 11), _inputs(device, 1), _inputs(device, 37)]


class TestDeploy(DeployContract):
    module = MODULE
    build_info = BUILD_INFO
    dynamic_shapes = DYNAMIC_SHAPES

    def make_model(self) -> nn.Module:
        return Model()

    def example_inputs(self, device: str) -> tuple[torch.Tensor, ...]:
        return example_inputs(device)

    def sample_inputs(self, device: str) -> list[list[torch.Tensor]]:
        return sample_inputs(device)

    def test_pt2_is_inference_only(self, deployed) -> None:
        """What the README's "Deploying" says is not supported: a loaded package
        records no autograd history (backward raises) and carries no forward-AD
        tangent (the output's tangent is None, never a wrong number)."""
        import torch.autograd.forward_ad as fwAD

        device, _, package = deployed
        # In process: where torch itself cannot load a package (the control
        # crashes its process) this would take the test session down.
        self.skip_if_torch_cannot_load(device)
        run = torch._inductor.aoti_load_package(str(package))
        x = sample_inputs(device)[0][0].requires_grad_()
        out = run(x)
        assert out.grad_fn is None and not out.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            out.sum().backward()
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
            assert fwAD.unpack_dual(run(dual)).tangent is None
