"""Deployment: a layer calling round_op.round_ste, exported with a dynamic
batch, compiled by AOTInductor into a .pt2, then run in a fresh Python that
imports only torch and round_op, and by the C++ runner with no Python in its
process (opscommon.deploy). Outputs must equal eager's."""

from __future__ import annotations

import os
import subprocess

import pytest
import round_op
import torch
from opscommon import deploy
from opscommon.testing import DEVICES, cuda_usable
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
# (other sizes: the batch is dynamic). scripts/deploy_across.py uses them too.
DYNAMIC_SHAPES = ({0: torch.export.Dim("batch", min=1, max=1 << 16)},)


def example_inputs(device: str) -> tuple[torch.Tensor, ...]:
    return (torch.randn(5, 8, device=device),)


def _inputs(device: str, batch: int) -> list[torch.Tensor]:
    return [torch.randn(batch, 8, device=device) * 3]


def sample_inputs(device: str) -> list[list[torch.Tensor]]:
    return [_inputs(device, 11), _inputs(device, 1), _inputs(device, 37)]


def _eager(model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(*inputs)]


def test_library_path_prints_the_compiled_library() -> None:
    path = deploy.library_path(MODULE)
    assert os.path.basename(path).startswith("_C") and path.endswith(".so")
    assert os.path.dirname(path) == os.path.dirname(round_op.__file__)


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
    with pytest.raises(RuntimeError, match="round_op"):
        deploy.run_in_cpp(runner, package, [], _inputs(device, 3), device)


def test_cpp_runner_refuses_a_process_with_libpython(deployed, runner, tmp_path) -> None:
    """The runner's own check fires when libpython is in its process."""
    libpython = deploy.libpython_path()
    if libpython is None:
        pytest.skip("this Python has no shared libpython to preload")
    device, _, package = deployed
    torch.save(_inputs(device, 2), tmp_path / "in.pt")
    cmd = [str(runner), "--library", deploy.library_path(MODULE), "--package", str(package)]
    cmd += ["--inputs", str(tmp_path / "in.pt"), "--outputs", str(tmp_path / "out.pt"), "--device", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LD_PRELOAD": libpython})
    assert proc.returncode == 3, proc.stderr
    assert "libpython is mapped" in proc.stderr


def test_pt2_is_inference_only(deployed) -> None:
    """What the README's "Deploying" says is not supported: a loaded package
    records no autograd history (backward raises) and carries no forward-AD
    tangent (the output's tangent is None, never a wrong number)."""
    import torch.autograd.forward_ad as fwAD

    device, _, package = deployed
    if device == "cuda":
        # Seen on an H100 with torch 2.11+cu130: loading a CUDA .pt2 with
        # aoti_load_package in a Python process crashed the process
        # (segfault in _load_aoti; the C++ runner ran the same package).
        # In process it would take the whole test session down with it.
        pytest.skip("loading a CUDA .pt2 in Python crashed the process on torch 2.11 (open: issue 26)")
    run = torch._inductor.aoti_load_package(str(package))
    x = sample_inputs(device)[0][0].requires_grad_()
    out = run(x)
    assert out.grad_fn is None and not out.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
        assert fwAD.unpack_dual(run(dual)).tangent is None
