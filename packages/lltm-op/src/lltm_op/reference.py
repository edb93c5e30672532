"""The LLTM cell in plain PyTorch: the tutorial's Python version, the baseline
that tests compare against and benchmarks measure."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def lltm_reference(
    input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor, old_cell: Tensor
) -> tuple[Tensor, Tensor]:
    """Same signature and results as :func:`lltm_op.lltm`, in torch ops only."""
    X = torch.cat([old_h, input], dim=1)
    gate_weights = F.linear(X, weights, bias)
    gates = gate_weights.chunk(3, dim=1)
    input_gate = torch.sigmoid(gates[0])
    output_gate = torch.sigmoid(gates[1])
    candidate_cell = F.elu(gates[2])
    new_cell = old_cell + candidate_cell * input_gate
    new_h = torch.tanh(new_cell) * output_gate
    return new_h, new_cell
