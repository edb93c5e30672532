"""vecadd-op's own smoke test, run in the fresh environment of `python -m tools.conda_build`:
the forward pass is a + b, the gradient reaches both inputs.

It runs after the generic smoke test (import, a kernel for every operator);
the recipe tests (the package's pytest suite) ran at build time. A package
with no smoke.py gets the generic one only.
"""

import torch
import vecadd_op

a = torch.randn(1000, requires_grad=True)
b = torch.randn(1000, requires_grad=True)
y = vecadd_op.add(a, b)
(y * 3).sum().backward()
print("vecadd_op from", vecadd_op.__file__, "build info:", vecadd_op.BUILD_INFO)
print("torch", torch.__version__, "CUDA", torch.version.cuda)
print("forward : max |a+b - add(a,b)| =", (y - (a + b)).abs().max().item())
print("backward: grad a", a.grad[:3].tolist(), "grad b", b.grad[:3].tolist())
assert torch.equal(y, a + b) and torch.all(a.grad == 3) and torch.all(b.grad == 3)
print("forward and backward as expected")
