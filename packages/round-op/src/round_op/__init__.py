"""round_op: differentiable round (straight-through estimator) as a PyTorch op.

``round_ste(x)`` rounds half up (``floor(x + 0.5)`` of the stored value) in
the forward pass; in the backward pass the incoming gradient passes through
unchanged. Registered as ``torch.ops.round_op.round_ste``.
"""

from __future__ import annotations

from ._runtime import BUILD_INFO
from .ops import RoundSTE, round_ste

__version__: str = BUILD_INFO["version"]

__all__ = ["RoundSTE", "round_ste", "__version__"]
