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
* variable lengths (``PackedSequence``): the packed rows are time-major
  with the sequences sorted longest first, so step t is the first
  ``batch_sizes[t]`` sequences. The packed rows are placed in a zero-padded
  ``[T, B, F]`` batch and the op runs once on it with ``batch_sizes``: each
  step computes its leading rows only (no step is computed on padding),
  each sequence's final state is that of its own last step, and the outputs
  are packed again. On CUDA the fused kernels mask the rows past their
  sequence's end, so a packed run keeps one launch per layer and direction
  where a padded one has it. Under forward AD, torch.func, autocast and
  ``torch.compile`` the steps run instead as segments of constant batch
  size, one call each on a ``[steps, rows, F]`` view of the packed data,
  the state of its leading rows carried into the next segment.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from . import _runtime
from .ops import _check_size
from .sequence import _run as _run_sequence
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


# -- variable lengths: the packed layout ---------------------------------------------------
# A PackedSequence holds its steps time-major: step t is batch_sizes[t] rows
# (the sequences still running, longest first), so the steps split into
# segments of constant batch size whose rows are contiguous in the data: one
# segment is a [steps, rows, F] view, one call of the fused op, no padding
# anywhere.


def _check_packed(input: PackedSequence) -> list[int]:
    """batch_sizes as a list, after the checks that the packed layout
    relies on (a hand-made PackedSequence gets an error, not wrong rows)."""
    data, sizes = input.data, input.batch_sizes
    where = f"{NAME}: argument 'input' (a PackedSequence)"
    if not isinstance(sizes, Tensor) or sizes.dim() != 1 or sizes.dtype != torch.int64 or sizes.device.type != "cpu":
        raise ValueError(f"{where} must have batch_sizes a 1-D int64 CPU tensor")
    batch_sizes = sizes.tolist()
    if any(b < 1 for b in batch_sizes) or any(a < b for a, b in zip(batch_sizes, batch_sizes[1:])):
        raise ValueError(f"{where} must have batch_sizes positive and non-increasing, got {batch_sizes}")
    if sum(batch_sizes) != data.shape[0]:
        raise ValueError(
            f"{where} holds {data.shape[0]} rows of data, but its batch_sizes add up to {sum(batch_sizes)}"
        )
    batch = batch_sizes[0] if batch_sizes else 0
    for name in ("sorted_indices", "unsorted_indices"):
        index = getattr(input, name)
        if index is not None and (not isinstance(index, Tensor) or index.shape != (batch,)):
            raise ValueError(f"{where} must have {name} of shape [{batch}] (the batch size)")
    return batch_sizes


def _segments(batch_sizes: list[int]) -> list[tuple[int, int, int, int]]:
    """(first data row, steps, rows, rows of the next segment) of each run of
    equal batch sizes."""
    out = []
    start = t = 0
    T = len(batch_sizes)
    while t < T:
        rows = batch_sizes[t]
        t1 = t
        while t1 < T and batch_sizes[t1] == rows:
            t1 += 1
        out.append((start, t1 - t, rows, batch_sizes[t1] if t1 < T else 0))
        start += (t1 - t) * rows
        t = t1
    return out


def _reverse_index(batch_sizes: list[int], device: torch.device) -> Tensor:
    """The permutation of packed rows that reverses every sequence within its
    own length (step t of sequence b <-> step length_b - 1 - t); its own
    inverse."""
    sizes = torch.tensor(batch_sizes, dtype=torch.int64)
    T, B = len(batch_sizes), batch_sizes[0]
    offsets = torch.cumsum(sizes, 0) - sizes
    b = torch.arange(B)
    lengths = (sizes.unsqueeze(0) > b.unsqueeze(1)).sum(1)  # [B]
    t = torch.arange(T).unsqueeze(1)  # [T, 1]
    valid = b.unsqueeze(0) < sizes.unsqueeze(1)  # [T, B]: in the packed order
    source = offsets[(lengths.unsqueeze(0) - 1 - t).clamp_min(0)] + b
    return source[valid].to(device)


def _padded_index(batch_sizes: list[int], device: torch.device) -> Tensor:
    """The row of each packed row in the padded ``[T * B]`` layout: step t,
    sequence b -> t * B + b."""
    sizes = torch.tensor(batch_sizes, dtype=torch.int64)
    T, B = len(batch_sizes), batch_sizes[0]
    rows = torch.arange(B)
    # Row-major over (t, b) with b < batch_sizes[t]: the packed order.
    return (torch.arange(T).unsqueeze(1) * B + rows)[rows < sizes.unsqueeze(1)].to(device)


def _packed_plan_eager(input: PackedSequence, bidirectional: bool, one_call: bool):
    batch_sizes = _check_packed(input)
    segments = _segments(batch_sizes)
    index = padded = None
    if bidirectional and len(segments) > 1:
        index = _reverse_index(batch_sizes, input.data.device)
    if one_call and len(segments) > 1:
        padded = _padded_index(batch_sizes, input.data.device)
    return (batch_sizes[0] if batch_sizes else 0), segments, index, padded


# The plan (checks, segments, the reverse permutation) is read from the
# lengths on the host: under torch.compile it runs outside the graph (a graph
# break: fullgraph=True cannot take a PackedSequence), and the segments'
# sizes reach the traced op calls as constants that dynamo guards on.
_PLAN_REASON = (
    "LLTMSequence: a PackedSequence's segments of constant batch size are read from its batch_sizes on the "
    "host (one op call per segment), a graph break; compile with fullgraph=False, or give padded input"
)
_DISABLE_KWARGS = {"reason": _PLAN_REASON} if "reason" in inspect.signature(torch.compiler.disable).parameters else {}
_plan_disabled = False


def _packed_plan(input: PackedSequence, bidirectional: bool, one_call: bool):
    """_packed_plan_eager; replaced by its torch.compiler.disable wrapper when
    the first LLTMSequence is made (_disable_packed_plan_for_compile)."""
    return _packed_plan_eager(input, bidirectional, one_call)


def _disable_packed_plan_for_compile() -> None:
    """Make the module-level _packed_plan run outside the graph under
    torch.compile, once. Not at import: torch.compiler.disable imports
    torch._dynamo (and with it triton, which turns the GIL back on in a
    free-threaded Python). And the disabled function itself is what forward
    calls: torch 2.11 skips the whole frame, instead of breaking the graph,
    at a disabled call inlined from another function."""
    global _packed_plan, _plan_disabled
    if not _plan_disabled:
        _packed_plan = torch.compiler.disable(_packed_plan_eager, **_DISABLE_KWARGS)
        _plan_disabled = True


def _run_packed(data: Tensor, w: Tensor, b: Tensor, h0: Tensor, c0: Tensor, segments):
    """One layer, one direction over packed rows data [N, F]: output [N, S]
    in the same layout, h_n, c_n [B, S] (each sequence's own last step)."""
    S = h0.shape[1]
    if not segments:  # no step at all
        return data.new_zeros(0, S), h0, c0
    h, c = h0, c0
    outs, h_done, c_done = [], [], []
    for start, steps, rows, next_rows in segments:
        x = data[start : start + steps * rows].reshape(steps, rows, data.shape[1])
        out, (h, c) = lltm_sequence(x, w, b, h, c)
        outs.append(out.reshape(steps * rows, S))
        if next_rows < rows:
            # Rows next_rows.. have ended: their state is final. The rows that
            # go on are the leading ones (longest first).
            h_done.append(h[next_rows:])
            c_done.append(c[next_rows:])
            h, c = h[:next_rows], c[:next_rows]
    output = torch.cat(outs) if len(outs) > 1 else outs[0]
    if len(h_done) == 1:
        return output, h_done[0], c_done[0]
    return output, torch.cat(h_done[::-1]), torch.cat(c_done[::-1])


def _run_packed_one_call(data: Tensor, w: Tensor, b: Tensor, h0: Tensor, c0: Tensor, batch_sizes: Tensor, padded):
    """_run_packed in one op call: the packed rows in a zero-padded [T, B, F]
    batch, the op running the first batch_sizes[t] rows at step t."""
    T, B, S = batch_sizes.shape[0], h0.shape[0], h0.shape[1]
    x = data.new_zeros(T * B, data.shape[1]).index_copy(0, padded, data).view(T, B, data.shape[1])
    out, h, c, _, _ = _run_sequence(x, w, b, h0, c0, batch_sizes)
    return out.reshape(T * B, S).index_select(0, padded), h, c


def _reverse(t: Tensor, segments, index: Tensor | None) -> Tensor:
    """t (padded [T, B, ...] when segments is None, else packed rows [N, ...])
    with every sequence reversed within its own length."""
    if not segments:
        return t.flip(0)
    if len(segments) == 1:  # one length: the packed rows are [steps, rows]
        steps, rows = segments[0][1], segments[0][2]
        return t.reshape(steps, rows, t.shape[-1]).flip(0).reshape(steps * rows, t.shape[-1])
    return t.index_select(0, index)


def _run_padded(x: Tensor, w: Tensor, b: Tensor, h0: Tensor, c0: Tensor):
    out, (h, c) = lltm_sequence(x, w, b, h0, c0)
    return out, h, c


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

    Padded input works under ``torch.compile(fullgraph=True)`` and
    ``torch.export``; a ``PackedSequence``'s segments are read from its
    batch sizes on the host (a graph break under ``torch.compile``, refused
    by ``torch.export``).
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
        _disable_packed_plan_for_compile()  # before any trace of forward
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

    def flatten_parameters(self) -> None:
        """Nothing to do (nn.LSTM compacts its weights for cuDNN here; each
        layer and direction of this module is already one fused call on its
        own parameters). Kept so that code written for nn.LSTM runs."""

    def _layer_params(self, index: int) -> tuple[Tensor, Tensor]:
        w_name, b_name = self._names[index]
        w = getattr(self, w_name)
        # bias=False: the op takes a bias; zeros that nothing differentiates.
        b = getattr(self, b_name) if b_name is not None else w.new_zeros(w.shape[0])
        return w, b

    def _check_input(self, input) -> Tensor:
        if isinstance(input, PackedSequence):
            data = input.data
            if not isinstance(data, Tensor) or data.dim() != 2:
                raise ValueError(
                    f"{NAME}: argument 'input' (a PackedSequence) must hold [N, input_size] data, got "
                    f"{list(data.shape) if isinstance(data, Tensor) else type(data).__name__}"
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
        weights = getattr(self, self._names[0][0])
        if data.device != weights.device:
            raise RuntimeError(
                f"{NAME}: argument 'input' is on {data.device}, the module's parameters on {weights.device}"
            )
        # Under autocast the dtypes may differ (lltm_sequence casts, as
        # torch's autocast does for nn.LSTM).
        if data.dtype != weights.dtype and not torch.is_autocast_enabled(data.device.type):
            raise RuntimeError(
                f"{NAME}: argument 'input' has dtype {data.dtype}, the module's parameters {weights.dtype} "
                "(convert one to the other, e.g. module.to(input.dtype))"
            )
        return data

    def _check_hx(self, hx, batch: int, unbatched: bool, data: Tensor) -> tuple[Tensor, Tensor]:
        rows = self.num_layers * self.num_directions
        shape = [rows, self.hidden_size] if unbatched else [rows, batch, self.hidden_size]
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2):
            raise TypeError(f"{NAME}: argument 'hx' must be a tuple (h_0, c_0), got {type(hx).__name__}")
        autocast = torch.is_autocast_enabled(data.device.type)
        for name, t in zip(("h_0", "c_0"), hx):
            if not isinstance(t, Tensor):
                raise TypeError(f"{NAME}: argument 'hx' {name} must be a Tensor, got {type(t).__name__}")
            if list(t.shape) != shape:
                raise ValueError(
                    f"{NAME}: argument 'hx' {name} must have shape {shape} (num_layers * num_directions, "
                    f"{'' if unbatched else 'batch, '}hidden_size), got {list(t.shape)}"
                )
            if t.device != data.device:
                raise RuntimeError(f"{NAME}: argument 'hx' {name} is on {t.device}, 'input' on {data.device}")
            if t.dtype != data.dtype and not autocast:
                raise RuntimeError(f"{NAME}: argument 'hx' {name} has dtype {t.dtype}, 'input' {data.dtype}")
        h0, c0 = hx
        if unbatched:
            h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
        return h0, c0

    def forward(
        self, input: Tensor | PackedSequence, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        """``(output, (h_n, c_n))`` as :class:`torch.nn.LSTM` returns them
        (see the class docstring for the shapes)."""
        data = self._check_input(input)
        packed = isinstance(input, PackedSequence)
        unbatched = False
        segments = reverse_index = padded_index = None
        if packed:
            if torch.compiler.is_exporting():
                raise RuntimeError(
                    f"{NAME}: a PackedSequence 'input' cannot be exported (its segments of constant batch "
                    "size are read from batch_sizes on the host); export the module on padded input [T, B, F]"
                )
            # One op call per layer and direction, except where only the
            # public lltm_sequence has the feature (see the module docstring).
            # Under torch.compile the rest is not traced at all.
            one_call = (
                not torch.compiler.is_compiling()
                and not _runtime.forward_ad_active()
                and not _runtime.functorch_active()
                and not _runtime.autocast_enabled(data.device.type)
            )
            batch, segments, reverse_index, padded_index = _packed_plan(input, self.bidirectional, one_call)
            x = data  # [N, F], the packed rows
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
            zeros = data.new_zeros(self.num_layers * D, batch, H)
            h0, c0 = zeros, zeros
        else:
            h0, c0 = self._check_hx(hx, batch, unbatched, data)
            if packed and input.sorted_indices is not None:
                # The packed rows are sorted longest first; so is the state.
                h0, c0 = h0.index_select(1, input.sorted_indices), c0.index_select(1, input.sorted_indices)
        # The reverse direction: each sequence reversed within its own length
        # (padded: the time axis; packed: a permutation of the rows, a flip
        # of the time axis for one segment), run forward, and reversed back.
        layer_input = x
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outs = []
            for direction in range(D):
                k = layer * D + direction
                w, b = self._layer_params(k)
                seq = _reverse(layer_input, segments, reverse_index) if direction else layer_input
                if segments is None:
                    out, h, c = _run_padded(seq, w, b, h0[k], c0[k])
                elif padded_index is not None:
                    out, h, c = _run_packed_one_call(seq, w, b, h0[k], c0[k], input.batch_sizes, padded_index)
                else:
                    out, h, c = _run_packed(seq, w, b, h0[k], c0[k], segments)
                if direction:
                    out = _reverse(out, segments, reverse_index)
                outs.append(out)
                h_n.append(h)
                c_n.append(c)
            layer_input = outs[0] if D == 1 else torch.cat(outs, dim=-1)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, p=self.dropout, training=True)
        output = layer_input
        h_n, c_n = torch.stack(h_n), torch.stack(c_n)
        if packed:
            if input.unsorted_indices is not None:
                h_n, c_n = h_n.index_select(1, input.unsorted_indices), c_n.index_select(1, input.unsorted_indices)
            return PackedSequence(output, input.batch_sizes, input.sorted_indices, input.unsorted_indices), (h_n, c_n)
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
