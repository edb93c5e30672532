"""``LLTMSequence``: the LLTM over whole sequences with ``nn.LSTM``'s
interface (layers, directions, ``batch_first``, dropout between layers,
``PackedSequence``), every layer and direction one call of the fused op
``lltm_sequence`` (the time loop in C++/CUDA).

How each case maps onto the one-layer, one-direction primitive:

* layers: the output of layer l (both directions concatenated) is the input
  of layer l + 1, with dropout in between in training (not after the last);
* the reverse direction: the sequence reversed in time, run forward, its
  outputs reversed back; with variable lengths each sequence is reversed
  within its own length, so it starts at its own last step;
* variable lengths (``PackedSequence``): the sequences are sorted by length
  (longest first), so the steps split into segments in which the same
  leading rows are still running; one call per segment on those rows, the
  state of the rows that have ended carried unchanged. No step is computed
  on padding, and each sequence's final state is its own.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .ops import _check_size
from .sequence import lltm_sequence

NAME = "LLTMSequence"


def _check_int(name: str, value, minimum: int) -> int:
    return _check_size(name, value, minimum, NAME)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{NAME}: {name} must be a bool, got {type(value).__name__}")
    return value


def _check_dropout(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{NAME}: dropout must be a number in [0, 1], got {type(value).__name__}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{NAME}: dropout must be a number in [0, 1], got {value}")
    return float(value)


def _reverse_within_lengths(x: Tensor, lengths: list[int] | None) -> Tensor:
    """x [T, B, ...] with each sequence b's first lengths[b] steps reversed
    (padding left in place); the whole time axis when lengths is None."""
    if lengths is None:
        return x.flip(0)
    T, B = x.shape[0], x.shape[1]
    t = torch.arange(T, device=x.device).unsqueeze(1)
    n = torch.as_tensor(lengths, device=x.device).unsqueeze(0)
    index = torch.where(t < n, n - 1 - t, t)  # [T, B]; an involution
    return x.gather(0, index.view(T, B, *([1] * (x.dim() - 2))).expand_as(x))


def _segments(lengths: list[int]) -> list[tuple[int, int, int]]:
    """(t0, t1, rows) with rows sequences running in steps t0 .. t1 - 1, for
    lengths sorted longest first."""
    out = []
    t0 = 0
    for rows in range(len(lengths), 0, -1):
        t1 = lengths[rows - 1]
        if t1 > t0:
            out.append((t0, t1, rows))
            t0 = t1
    return out


def _run_direction(x: Tensor, w: Tensor, b: Tensor, h0: Tensor, c0: Tensor, lengths: list[int] | None):
    """One layer, one direction, forward in time: outputs [T, B, S] (zero on
    padding), h_n, c_n [B, S] (each sequence's own last step)."""
    if lengths is None:
        out, (h, c) = lltm_sequence(x, w, b, h0, c0)
        return out, h, c
    T, B = x.shape[0], x.shape[1]
    S = h0.shape[1]
    h, c = h0, c0
    pieces = []
    for t0, t1, rows in _segments(lengths):
        out, (h_r, c_r) = lltm_sequence(x[t0:t1, :rows], w, b, h[:rows], c[:rows])
        if rows < B:
            # The rows that have ended keep their state; their outputs are zero.
            h = torch.cat((h_r, h[rows:]))
            c = torch.cat((c_r, c[rows:]))
            out = torch.cat((out, out.new_zeros(t1 - t0, B - rows, S)), dim=1)
        else:
            h, c = h_r, c_r
        pieces.append(out)
    if not pieces:  # every length 0 (T == 0)
        return x.new_zeros(T, B, S), h0, c0
    outputs = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if outputs.shape[0] < T:
        outputs = torch.cat((outputs, outputs.new_zeros(T - outputs.shape[0], B, S)))
    return outputs, h, c


class LLTMSequence(nn.Module):
    """The LLTM cell over whole sequences, with ``nn.LSTM``'s interface.

    ``LLTMSequence(input_size, hidden_size, num_layers=1, bias=True,
    batch_first=False, dropout=0.0, bidirectional=False, proj_size=0,
    device=None, dtype=None)``: the same arguments as ``nn.LSTM`` (and
    ``input_features`` / ``state_size``, the names of :class:`lltm_op.LLTM`,
    as keyword aliases of ``input_size`` / ``hidden_size``). ``proj_size``
    other than 0 is refused.

    ``forward(input, hx=None) -> (output, (h_n, c_n))`` with ``nn.LSTM``'s
    shapes: ``input`` ``[T, B, input_size]`` (``[B, T, input_size]`` with
    ``batch_first``), ``[T, input_size]`` unbatched, or a ``PackedSequence``
    (then ``output`` is one too); ``hx`` an optional ``(h_0, c_0)``, each
    ``[D * num_layers, B, hidden_size]`` (D = 2 if bidirectional, else 1),
    zeros when omitted; ``output`` ``[T, B, D * hidden_size]``; ``h_n`` and
    ``c_n`` like ``h_0``, each sequence's own final state.

    Parameters: one layer in one direction has those of :class:`lltm_op.LLTM`,
    ``weights`` ``[3H, H + input_size]`` (columns multiplying ``[h, x]``) and
    ``bias`` ``[3H]``, so a cell's ``state_dict`` loads into it and back;
    otherwise ``weights_l{k}`` / ``bias_l{k}`` for layer k (input
    ``input_size`` for k = 0, ``D * hidden_size`` after) and
    ``weights_l{k}_reverse`` / ``bias_l{k}_reverse`` for the reverse
    direction, as nn.LSTM names its own. ``bias=False``: no bias parameters.
    All initialised uniform in ``±1/sqrt(hidden_size)``.

    Differs from nn.LSTM in the cell: three gates (input, output, an ELU
    candidate) and no forget gate, so the cell state accumulates over time.
    """

    def __init__(
        self,
        input_size: int | None = None,
        hidden_size: int | None = None,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device=None,
        dtype=None,
        *,
        input_features: int | None = None,
        state_size: int | None = None,
    ) -> None:
        super().__init__()
        input_size = self._alias("input_size", input_size, "input_features", input_features)
        hidden_size = self._alias("hidden_size", hidden_size, "state_size", state_size)
        self.input_size = _check_int("input_size", input_size, 0)
        self.hidden_size = _check_int("hidden_size", hidden_size, 1)
        self.num_layers = _check_int("num_layers", num_layers, 1)
        # nn.LSTM keeps this flag as `bias`; here that name is the one-layer
        # module's bias parameter (LLTM's layout).
        self._has_bias = _check_bool("bias", bias)
        self.batch_first = _check_bool("batch_first", batch_first)
        self.dropout = _check_dropout(dropout)
        self.bidirectional = _check_bool("bidirectional", bidirectional)
        if isinstance(proj_size, bool) or not isinstance(proj_size, numbers.Integral) or proj_size != 0:
            raise ValueError(
                f"{NAME}: proj_size={proj_size!r} is not supported (the LLTM has no projection); use proj_size=0"
            )
        self.proj_size = 0
        if self.dropout > 0 and self.num_layers == 1:
            warnings.warn(
                f"{NAME}: dropout={self.dropout} with num_layers=1 has no effect: dropout is applied "
                "between layers, not after the last (as nn.LSTM)",
                stacklevel=2,
            )
        factory = {"device": device, "dtype": dtype}
        H = self.hidden_size
        self._names: list[tuple[str, str | None]] = []
        for layer in range(self.num_layers):
            width = self.input_size if layer == 0 else self.num_directions * H
            for direction in range(self.num_directions):
                w_name, b_name = self._param_names(layer, direction)
                setattr(self, w_name, nn.Parameter(torch.empty(3 * H, H + width, **factory)))
                if self._has_bias:
                    setattr(self, b_name, nn.Parameter(torch.empty(3 * H, **factory)))
                else:
                    self.register_parameter(b_name, None)
                self._names.append((w_name, b_name if self._has_bias else None))
        self.reset_parameters()

    @staticmethod
    def _alias(name: str, value, alias: str, alias_value):
        if alias_value is None:
            if value is None:
                raise TypeError(f"{NAME}: missing argument '{name}' (or its alias '{alias}')")
            return value
        if value is not None:
            raise TypeError(f"{NAME}: give '{name}' or its alias '{alias}', not both")
        return alias_value

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    def _param_names(self, layer: int, direction: int) -> tuple[str, str]:
        if self.num_layers == 1 and not self.bidirectional:
            return "weights", "bias"
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        return "weights" + suffix, "bias" + suffix

    # LLTM's names, kept for code written against the one-layer module.
    @property
    def input_features(self) -> int:
        return self.input_size

    @property
    def state_size(self) -> int:
        return self.hidden_size

    def reset_parameters(self) -> None:
        stdv = 1.0 / math.sqrt(self.hidden_size)
        for weight in self.parameters():
            nn.init.uniform_(weight, -stdv, +stdv)

    @classmethod
    def from_cell(cls, cell: nn.Module) -> LLTMSequence:
        """A one-layer sequence module that shares ``cell``'s parameters (no copy)."""
        seq = cls(cell.input_features, cell.state_size, device="meta")
        seq.weights = cell.weights
        seq.bias = cell.bias
        return seq

    # -- forward ----------------------------------------------------------------------------------

    def _layer_params(self, index: int, like: Tensor) -> tuple[Tensor, Tensor]:
        w_name, b_name = self._names[index]
        w = getattr(self, w_name)
        b = getattr(self, b_name) if b_name is not None else w.new_zeros(w.shape[0])
        return w, b

    def _check_input(self, input) -> None:
        if isinstance(input, PackedSequence):
            data = input.data
            if data.dim() != 2:
                raise ValueError(
                    f"{NAME}: a PackedSequence 'input' must hold [N, input_size] data, got {list(data.shape)}"
                )
        elif isinstance(input, Tensor):
            if input.dim() not in (2, 3):
                raise ValueError(
                    f"{NAME}: argument 'input' must be 3-D [T, B, input_size] ([B, T, input_size] with "
                    f"batch_first) or 2-D unbatched [T, input_size], got {input.dim()}-D {list(input.shape)}"
                )
            data = input
        else:
            raise TypeError(
                f"{NAME}: argument 'input' must be a Tensor or a PackedSequence, got {type(input).__name__}"
            )
        if data.shape[-1] != self.input_size:
            raise ValueError(f"{NAME}: argument 'input' must have {self.input_size} features, got {data.shape[-1]}")

    def _check_hx(self, hx, batch: int, unbatched: bool, like: Tensor) -> tuple[Tensor, Tensor]:
        rows = self.num_layers * self.num_directions
        shape = [rows, self.hidden_size] if unbatched else [rows, batch, self.hidden_size]
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2):
            raise TypeError(f"{NAME}: argument 'hx' must be a tuple (h_0, c_0), got {type(hx).__name__}")
        for name, t in zip(("h_0", "c_0"), hx):
            if not isinstance(t, Tensor):
                raise TypeError(f"{NAME}: argument 'hx' {name} must be a Tensor, got {type(t).__name__}")
            if list(t.shape) != shape:
                raise ValueError(
                    f"{NAME}: argument 'hx' {name} must have shape {shape} (num_layers * num_directions, "
                    f"{'' if unbatched else 'batch, '}hidden_size), got {list(t.shape)}"
                )
        h0, c0 = hx
        if unbatched:
            h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
        return h0, c0

    def forward(self, input, hx: tuple[Tensor, Tensor] | None = None):
        self._check_input(input)
        packed = isinstance(input, PackedSequence)
        unbatched = False
        lengths = None
        if packed:
            sorted_indices, unsorted_indices = input.sorted_indices, input.unsorted_indices
            # Padded, in the packed (sorted, longest first) order.
            x, length_tensor = torch.nn.utils.rnn.pad_packed_sequence(PackedSequence(input.data, input.batch_sizes))
            lengths = length_tensor.tolist()
            if lengths and lengths[-1] == lengths[0]:
                lengths = None  # all the same: one call per layer and direction
        else:
            x = input
            if x.dim() == 2:
                unbatched = True
                x = x.unsqueeze(1)
            elif self.batch_first:
                x = x.transpose(0, 1)
        batch = x.shape[1]
        H, D = self.hidden_size, self.num_directions
        if hx is None:
            zeros = x.new_zeros(self.num_layers * D, batch, H)
            h0, c0 = zeros, zeros
        else:
            h0, c0 = self._check_hx(hx, batch, unbatched, x)
            if packed and sorted_indices is not None:
                h0, c0 = h0.index_select(1, sorted_indices), c0.index_select(1, sorted_indices)
        layer_input = x
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outs = []
            for direction in range(D):
                k = layer * D + direction
                w, b = self._layer_params(k, layer_input)
                seq = layer_input if direction == 0 else _reverse_within_lengths(layer_input, lengths)
                out, h, c = _run_direction(seq, w, b, h0[k], c0[k], lengths)
                outs.append(out if direction == 0 else _reverse_within_lengths(out, lengths))
                h_n.append(h)
                c_n.append(c)
            layer_input = outs[0] if D == 1 else torch.cat(outs, dim=2)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, p=self.dropout, training=True)
        output = layer_input
        h_n, c_n = torch.stack(h_n), torch.stack(c_n)
        if packed:
            if lengths is None:
                data = output.reshape(-1, output.shape[-1])
            else:
                data = torch.nn.utils.rnn.pack_padded_sequence(output, lengths).data
            if unsorted_indices is not None:
                h_n, c_n = h_n.index_select(1, unsorted_indices), c_n.index_select(1, unsorted_indices)
            return PackedSequence(data, input.batch_sizes, sorted_indices, unsorted_indices), (h_n, c_n)
        if unbatched:
            return output.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, (h_n, c_n)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if not self._has_bias:
            s += ", bias=False"
        if self.batch_first:
            s += ", batch_first=True"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s
