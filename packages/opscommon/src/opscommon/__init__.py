"""opscommon: header-only C++/CUDA helpers and the build helper for op packages.

A build-time dependency only: op packages compile against the headers in
``get_include()`` and build their extension with :mod:`opscommon.build`; at
run time they need nothing but torch.
"""

from __future__ import annotations

import os

__version__ = "0.5.2"

# The oldest torch whose LibTorch stable ABI every op binary targets.
TORCH_TARGET_VERSION = (2, 10)


def get_include() -> str:
    """Return the folder that holds ``opscommon/*.h``, for ``include_dirs``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


__all__ = ["TORCH_TARGET_VERSION", "get_include", "__version__"]
