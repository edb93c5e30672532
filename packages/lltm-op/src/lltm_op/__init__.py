"""lltm_op: the LLTM recurrent cell as PyTorch custom ops with fused CPU and
CUDA kernels.

``lltm(input, weights, bias, old_h, old_cell) -> (new_h, new_cell)`` and the
``LLTM(input_features, state_size)`` module; over whole sequences,
``lltm_sequence(input, weights, bias, old_h, old_cell) -> (outputs, (h_n, c_n))``
and the ``LLTMSequence`` module (``nn.LSTM``'s interface: layers, directions,
``batch_first``, dropout, ``PackedSequence``). The matrix product stays in
torch; the elementwise work of the cell is one fused op each way, registered
as ``torch.ops.lltm_op.cell_forward`` and ``torch.ops.lltm_op.cell_backward``.
"""

from __future__ import annotations

from ._runtime import BUILD_INFO
from .ops import LLTM, lltm
from .reference import lltm_reference
from .rnn import LLTMSequence
from .sequence import lltm_sequence

__version__: str = BUILD_INFO["version"]

__all__ = ["LLTM", "LLTMSequence", "lltm", "lltm_reference", "lltm_sequence", "__version__"]
