"""lltm-op's own smoke test, run in the fresh environment of `python -m tools.conda_build`:
a forward and a backward pass of the LLTM cell against the pure-PyTorch
reference (float64).

It runs after the generic smoke test (import, a kernel for every operator);
the recipe tests (the package's pytest suite) ran at build time. A package
with no smoke.py gets the generic one only.
"""

import lltm_op
import torch

torch.manual_seed(0)
batch, features, state = 16, 32, 128
cell = lltm_op.LLTM(features, state).double()
x = torch.randn(batch, features, dtype=torch.float64, requires_grad=True)
h = torch.randn(batch, state, dtype=torch.float64, requires_grad=True)
c = torch.randn(batch, state, dtype=torch.float64, requires_grad=True)
new_h, new_c = cell(x, (h, c))
(new_h.sum() + 2 * new_c.sum()).backward()
ref_args = [t.detach().clone().requires_grad_() for t in (x, cell.weights, cell.bias, h, c)]
ref_h, ref_c = lltm_op.lltm_reference(*ref_args)
(ref_h.sum() + 2 * ref_c.sum()).backward()
print("lltm_op", lltm_op.__version__, "from", lltm_op.__file__)
print("build info:", lltm_op.BUILD_INFO)
print("torch", torch.__version__, "CUDA", torch.version.cuda)
print(
    f"forward : new_h {tuple(new_h.shape)} new_c {tuple(new_c.shape)}, "
    f"max |diff| vs reference {max((new_h - ref_h).abs().max().item(), (new_c - ref_c).abs().max().item()):.3e}"
)
pairs = {
    "input": (x, ref_args[0]),
    "weights": (cell.weights, ref_args[1]),
    "bias": (cell.bias, ref_args[2]),
    "old_h": (h, ref_args[3]),
    "old_cell": (c, ref_args[4]),
}
for name, (a, r) in pairs.items():
    print(
        f"backward: grad {name:8s} {tuple(a.grad.shape)} norm {a.grad.norm().item():.6f}, "
        f"max |diff| vs reference {(a.grad - r.grad).abs().max().item():.3e}"
    )
    assert torch.allclose(a.grad, r.grad, rtol=1e-9, atol=1e-9), name
assert torch.allclose(new_h, ref_h) and torch.allclose(new_c, ref_c)
print("forward and backward match the pure-PyTorch reference")
