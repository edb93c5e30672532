"""round-op's own smoke test, run in the fresh environment of `python -m tools.conda_build`:
the forward pass rounds half up, the backward pass lets the gradient through.

It runs after the generic smoke test (import, a kernel for every operator);
the recipe tests (the package's pytest suite) ran at build time. A package
with no smoke.py gets the generic one only.
"""

import round_op
import torch

x = torch.tensor([-1.5, -0.5, 0.49, 0.5, 2.5], requires_grad=True)
y = round_op.round_ste(x)
(y * torch.arange(5.0)).sum().backward()
print("round_op from", round_op.__file__, "build info:", round_op.BUILD_INFO)
print("torch", torch.__version__, "CUDA", torch.version.cuda)
print("forward :", y.tolist())
print("backward:", x.grad.tolist())
assert y.tolist() == [-1.0, 0.0, 0.0, 1.0, 3.0] and x.grad.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
print("forward and backward as expected")
