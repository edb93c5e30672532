"""Deployment: a small sequence model (an embedding, lltm_op.LLTMSequence, a
linear head) exported with dynamic batch and sequence length, compiled by
AOTInductor into a .pt2, then run in a fresh Python that imports only torch
and lltm_op, and by the C++ runner with no Python in its process
(opscommon.deploy). Outputs must equal eager's."""

from __future__ import annotations

import lltm_op
import torch
from lltm_op._runtime import BUILD_INFO
from opscommon.testing import DeployContract
from torch import nn

MODULE = "lltm_op"
VOCAB, FEATURES, STATE, CLASSES = 50, 8, 16, 5


class Model(nn.Module):
    """Token ids ``[T, B]`` -> per-step logits ``[T, B, CLASSES]`` and the
    last hidden state ``[B, STATE]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, FEATURES)
        self.rnn = lltm_op.LLTMSequence(FEATURES, STATE)
        self.head = nn.Linear(STATE, CLASSES)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs, (h_n, _) = self.rnn(self.embed(tokens))
        return self.head(outputs), h_n


# What the export sees, and the inputs the deployed package is checked on
# (other lengths and batches: both are dynamic). scripts/deploy_across.py
# uses them too.
DYNAMIC_SHAPES = ({0: torch.export.Dim("steps", min=1, max=1 << 16), 1: torch.export.Dim("batch", min=1, max=1 << 16)},)


def example_inputs(device: str) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (7, 3), device=device),)


def _inputs(device: str, steps: int, batch: int) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (steps, batch), device=device)]


def sample_inputs(device: str) -> list[list[torch.Tensor]]:
    return [_inputs(device, 12, 5), _inputs(device, 1, 1), _inputs(device, 23, 9)]


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
