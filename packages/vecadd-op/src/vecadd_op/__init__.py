"""vecadd_op: elementwise vector add as a PyTorch custom op.

``add(a, b)`` returns ``a + b`` as a new tensor; ``add(a, b, out=c)`` writes
it into ``c``. Both tensors must have the same shape, dtype (float16,
bfloat16, float32, float64, int32 or int64) and device (CPU or CUDA); the
gradient flows to both inputs. Registered as ``torch.ops.vecadd_op.add``
(overloads ``default`` and ``out``).
"""

from __future__ import annotations

from ._runtime import BUILD_INFO
from .ops import DTYPES, VecAdd, add

__version__: str = BUILD_INFO["version"]

__all__ = ["DTYPES", "VecAdd", "add", "__version__"]
