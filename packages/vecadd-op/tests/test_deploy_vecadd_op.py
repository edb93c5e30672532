"""Deployment: a layer calling vecadd_op.add, exported with a dynamic
batch, compiled by AOTInductor into a .pt2, then run in a fresh Python that
imports only torch and vecadd_op, and by the C++ runner with no Python in its
process (opscommon.deploy). Outputs must equal eager's."""

from __future__ import annotations

import torch
import vecadd_op
from opscommon.testing import DeployContract
from torch import nn
from vecadd_op._runtime import BUILD_INFO

MODULE = "vecadd_op"


class Model(nn.Module):
    """A residual block whose sum is the op: linear(x) + tanh(x), then a
    linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(vecadd_op.add(self.inner(x), torch.tanh(x)))


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
