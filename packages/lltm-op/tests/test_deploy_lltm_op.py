"""Deployment: a small sequence model (an embedding, lltm_op.LLTMSequence, a
linear head) exported with dynamic batch and sequence length, compiled by
AOTInductor into a .pt2, then run in a fresh Python that imports only torch
and lltm_op, and by the C++ runner with no Python in its process
(opscommon.deploy). Outputs must equal eager's."""

from __future__ import annotations

import os
import subprocess

import lltm_op
import pytest
import torch
from lltm_op._runtime import BUILD_INFO
from opscommon import deploy
from opscommon.testing import DEVICES, cuda_usable
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


def _device(device: str) -> str:
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build of the package")
    return device


@pytest.fixture(scope="module", params=DEVICES)
def deployed(request, tmp_path_factory):
    """(device, model, .pt2 path): exported once per device for the module."""
    device = _device(request.param)
    torch.manual_seed(0)
    model = Model().to(device).eval()
    path = tmp_path_factory.mktemp(f"deploy-{device}") / "model.pt2"
    return device, model, deploy.export_and_package(model, example_inputs(device), DYNAMIC_SHAPES, path)


@pytest.fixture(scope="session")
def runner():
    return deploy.build_runner()


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


def _eager(model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model(*inputs))


def test_library_path_prints_the_compiled_library() -> None:
    path = deploy.library_path(MODULE)
    assert os.path.basename(path).startswith("_C") and path.endswith(".so")
    assert os.path.dirname(path) == os.path.dirname(lltm_op.__file__)


def test_pt2_runs_in_a_fresh_python(deployed) -> None:
    device, model, package = deployed
    inputs = sample_inputs(device)[0]
    outs = deploy.run_in_fresh_python(package, MODULE, inputs, device)
    deploy.assert_same_outputs(outs, _eager(model, inputs), device)


def test_pt2_runs_from_cpp_without_python(deployed, runner) -> None:
    device, model, package = deployed
    for inputs in sample_inputs(device)[1:]:
        outs, log = deploy.run_in_cpp(runner, package, [deploy.library_path(MODULE)], inputs, device)
        assert "no libpython mapped" in log
        deploy.assert_same_outputs(outs, _eager(model, inputs), device)


def test_cpp_runner_needs_the_op_library(deployed, runner) -> None:
    """Without the op's library the package cannot run: the test above
    really exercises the library loaded from the command line."""
    device, _, package = deployed
    with pytest.raises(RuntimeError, match="lltm_op"):
        deploy.run_in_cpp(runner, package, [], _inputs(device, 3, 2), device)


def test_cpp_runner_refuses_a_process_with_libpython(deployed, runner, tmp_path) -> None:
    """The runner's own check fires when libpython is in its process."""
    libpython = deploy.libpython_path()
    if libpython is None:
        pytest.skip("this Python has no shared libpython to preload")
    device, _, package = deployed
    torch.save(_inputs(device, 2, 2), tmp_path / "in.pt")
    cmd = [str(runner), "--library", deploy.library_path(MODULE), "--package", str(package)]
    cmd += ["--inputs", str(tmp_path / "in.pt"), "--outputs", str(tmp_path / "out.pt"), "--device", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LD_PRELOAD": libpython})
    assert proc.returncode == 3, proc.stderr
    assert "libpython is mapped" in proc.stderr
