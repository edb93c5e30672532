"""DDP (gloo, 2 CPU processes) with lltm-op and round-op matches one process."""

from __future__ import annotations

import pytest

pytest.importorskip("lltm_op")
pytest.importorskip("round_op")

import torch.distributed as dist  # noqa: E402
from ddp_train import compare  # noqa: E402


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_ddp_matches_single_process():
    result = compare("gloo")
    print(result)
    assert result["max_loss_diff"] < 1e-9
    assert result["max_param_diff"] < 1e-9
    assert result["loss_fell"]
