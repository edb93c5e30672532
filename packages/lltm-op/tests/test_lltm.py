"""lltm_op.lltm against the shared op contract, plus its own cases: accuracy
of every dtype against a float64 reference, absent output gradients, what is
saved for backward, CUDA graphs, and a short training loop."""

from __future__ import annotations

import math
import time
import warnings

import lltm_op
import pytest
import torch
from lltm_op import LLTM, lltm, lltm_reference
from lltm_op._runtime import BUILD_INFO
from opscommon.testing import DEVICES, BadInput, OpContract, cuda_usable, with_layout

OP = "lltm_op.lltm"
HALF_DTYPES = (torch.float16, torch.bfloat16)
cell_forward = torch.ops.lltm_op.cell_forward.default
cell_backward = torch.ops.lltm_op.cell_backward.default
cell_backward_new = torch.ops.lltm_op.cell_backward_from_new_cell.default

requires_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_usable(BUILD_INFO), reason="needs a CUDA GPU and a CUDA build"),
]


def need(device: str) -> str:
    if device == "cuda" and not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    return device


def make_args(batch, features, state, dtype=torch.float32, device="cpu", generator=None):
    """input, weights, bias, old_h, old_cell with gates of order one (neither
    saturated nor all linear), drawn in float64 and rounded to ``dtype``."""
    g = generator
    f64 = dict(dtype=torch.float64, device="cpu", generator=g)
    fan_in = max(1, state + features)
    args = (
        torch.randn(batch, features, **f64),
        (torch.rand(3 * state, state + features, **f64) * 2 - 1) * (2.0 / math.sqrt(fan_in)),
        torch.randn(3 * state, **f64) * 0.5,
        torch.randn(batch, state, **f64),
        torch.randn(batch, state, **f64),
    )
    return tuple(t.to(device=device, dtype=dtype) for t in args)


def reference64(*args):
    """The pure-PyTorch cell evaluated in float64 on the same (rounded) values."""
    return lltm_reference(*(t.double() for t in args))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    denom = ref.norm().item()
    err = (out.double() - ref).norm().item()
    return err / denom if denom else err


def random_cell_inputs(batch: int, state: int, gen: torch.Generator):
    """Float64 CPU inputs of the cell ops, drawn from `gen`: (gates, bias,
    old_cell) for `cell_forward` and (grad_h, grad_cell) that `cell_backward`
    takes before them."""

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return (r(batch, 3 * state), r(3 * state), r(batch, state)), (r(batch, state), r(batch, state))


class TestLLTMContract(OpContract):
    op_name = OP
    build_info = BUILD_INFO
    # (batch, input_features, state_size): batch 1, state sizes that are not
    # multiples of any vector width or block size, the tutorial size, empty.
    cases = [(1, 1, 1), (1, 3, 5), (4, 5, 3), (16, 32, 128), (3, 7, 130), (33, 4, 260), (0, 4, 6), (5, 2, 0)]
    grad_cases = [(2, 3, 4), (1, 2, 5), (3, 1, 8)]
    grad_inputs = (0, 1, 2, 3, 4)
    # The matrix product mixes every input element into whole rows of gates,
    # so injected NaN/inf/huge values do not propagate elementwise; the cell
    # kernels, which are elementwise, get them in test_cell_special_values.
    special_values = False
    # 500 steps of state under autocast.
    autocast_case = (4, 8, 16)
    autocast_calls = 500

    def make_inputs(self, case, dtype, device):
        return make_args(*case, dtype=dtype, device=device)

    def call(self, *args):
        return lltm(*args)

    def autocast_next_inputs(self, inputs, outputs):
        return (*inputs[:3], *outputs)

    def make_module(self, case, dtype, device):
        batch, features, state = case
        module = LLTM(features, state, device=device, dtype=dtype)
        x, _, _, h, c = make_args(batch, features, state, dtype=dtype, device=device)
        return module, (x, (h, c))

    def reference(self, *args):
        # The half types are checked against float64 on the same values
        # (the op computes in float32 inside); the others in their own dtype.
        if args[0].dtype in HALF_DTYPES:
            return reference64(*args)
        return lltm_reference(*args)

    def tolerance(self, dtype):
        return {
            torch.float16: {"atol": 3e-3, "rtol": 3e-3},
            torch.bfloat16: {"atol": 2.5e-2, "rtol": 2e-2},
        }.get(dtype, {})

    def opcheck_targets(self):
        return [cell_forward, cell_backward, cell_backward_new]

    @pytest.mark.parametrize("device", DEVICES)
    def test_opcheck(self, device):
        # The cell ops take (gates, old_cell) and (grad_h, grad_cell, gates,
        # old_cell), not the public function's five tensors: give each its own.
        device = self._device(device)
        for dtype in (torch.float32, torch.float64):
            for n, (batch, _, state) in enumerate(self.grad_cases):

                def r(*shape):
                    return torch.randn(*shape, dtype=dtype, device=device)

                gates, bias, old_cell = r(batch, 3 * state), r(3 * state), r(batch, state)
                gh, gc = r(batch, state), r(batch, state)
                torch.library.opcheck(cell_forward, tuple(t.clone().requires_grad_() for t in (gates, bias, old_cell)))
                torch.library.opcheck(cell_backward, (gh, gc, gates, bias, old_cell))
                new_cell = cell_forward(gates, bias, old_cell)[1]
                torch.library.opcheck(cell_backward_new, (gh, gc, gates, bias, new_cell))
                # The backward ops are differentiable (double backward).
                for op, cell in ((cell_backward, old_cell), (cell_backward_new, new_cell)):
                    torch.library.opcheck(op, tuple(t.clone().requires_grad_() for t in (gh, gc, gates, bias, cell)))
                if n or dtype != torch.float32:
                    continue
                # Once: no grad, partial grad, strided operands, absent and
                # expanded incoming gradients.
                torch.library.opcheck(cell_forward, (gates, bias, old_cell))
                torch.library.opcheck(cell_forward, (gates, bias.clone().requires_grad_(), old_cell))
                torch.library.opcheck(
                    cell_forward,
                    (with_layout(gates, "transposed"), with_layout(bias, "strided"), with_layout(old_cell, "strided")),
                )
                torch.library.opcheck(cell_backward, (None, gc, gates, bias, old_cell))
                torch.library.opcheck(cell_backward, (gh, None, gates, bias, old_cell))
                torch.library.opcheck(cell_backward, (None, None, gates, bias, old_cell))
                torch.library.opcheck(
                    cell_backward, (gh.sum(0, keepdim=True).expand(batch, state), None, gates, bias, old_cell)
                )
                torch.library.opcheck(cell_backward_new, (None, gc, gates, bias, new_cell))
                torch.library.opcheck(cell_backward_new, (gh, None, gates, bias, new_cell))

    def bad_inputs(self, device):
        def args(**replace):
            a = dict(zip(("input", "weights", "bias", "old_h", "old_cell"), make_args(16, 32, 128, device=device)))
            a.update(replace)
            return a

        def call(**replace):
            return lambda: lltm(**args(**replace))

        other = "meta" if device == "cpu" else "cpu"
        this = "cpu" if device == "cpu" else r"cuda:\d+"
        f32 = dict(device=device)

        def z(*shape, dtype=torch.float32, device=device):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return [
            BadInput(
                "bias shape",
                call(bias=torch.zeros(10, **f32)),
                rf"^{OP}: argument 'bias' must have shape \[384\], got \[10\]$",
            ),
            BadInput(
                "bias 2-D",
                call(bias=torch.zeros(1, 384, **f32)),
                rf"{OP}: argument 'bias' must have shape \[384\], got \[1, 384\]",
            ),
            BadInput(
                "weights shape",
                call(weights=torch.zeros(384, 128, **f32)),
                rf"{OP}: argument 'weights' must have shape \[384, 160\], got \[384, 128\]",
            ),
            BadInput(
                "weights transposed",
                call(weights=torch.zeros(160, 384, **f32)),
                rf"{OP}: argument 'weights' must have shape \[384, 160\], got \[160, 384\]",
            ),
            BadInput(
                "old_h batch",
                call(old_h=torch.zeros(15, 128, **f32)),
                rf"{OP}: argument 'old_h' must have shape \[16, \*\], got \[15, 128\]",
            ),
            BadInput(
                "old_cell state",
                call(old_cell=torch.zeros(16, 127, **f32)),
                rf"{OP}: argument 'old_cell' must have shape \[16, 128\], got \[16, 127\]",
            ),
            BadInput(
                "input 1-D",
                call(input=torch.zeros(32, **f32)),
                rf"{OP}: argument 'input' must have shape \[\*, \*\], got \[32\]",
            ),
            BadInput(
                "weights dtype",
                call(weights=torch.zeros(384, 160, dtype=torch.float64, device=device)),
                rf"{OP}: arguments 'input' and 'weights' must have the same dtype, got float32 and float64",
            ),
            BadInput(
                "old_cell dtype",
                call(old_cell=torch.zeros(16, 128, dtype=torch.bfloat16, device=device)),
                rf"{OP}: arguments 'input' and 'old_cell' must have the same dtype, got float32 and bfloat16",
            ),
            BadInput(
                "integer input",
                lambda: lltm(*(t.long() for t in make_args(2, 3, 4, device=device))),
                rf"{OP}: argument 'input' must be a floating-point tensor .*got int64",
            ),
            BadInput(
                "weights device",
                call(weights=torch.zeros(384, 160, device=other)),
                rf"{OP}: arguments 'input' and 'weights' must be on the same device, got {this} and {other}",
            ),
            BadInput(
                "old_cell device",
                call(old_cell=torch.zeros(16, 128, device=other)),
                rf"{OP}: arguments 'input' and 'old_cell' must be on the same device, got {this} and {other}",
            ),
            BadInput(
                "None", call(old_cell=None), rf"{OP}: argument 'old_cell' must be a tensor, got NoneType", TypeError
            ),
            BadInput("list", call(bias=[0.0] * 384), rf"{OP}: argument 'bias' must be a tensor, got list", TypeError),
            # The registered ops check their own arguments (C++ kernels).
            BadInput(
                "cell_forward gates shape",
                lambda: cell_forward(z(4, 8), z(9), z(4, 3)),
                r"lltm_op.cell_forward: argument 'gates' must have shape \[4, 9\], got \[4, 8\]",
            ),
            BadInput(
                "cell_forward bias shape",
                lambda: cell_forward(z(4, 9), z(1, 9), z(4, 3)),
                r"lltm_op.cell_forward: argument 'bias' must have shape \[9\], got \[1, 9\]",
            ),
            BadInput(
                "cell_forward dtype",
                lambda: cell_forward(z(4, 9), z(9), z(4, 3, dtype=torch.float64)),
                r"lltm_op.cell_forward: arguments 'gates' and 'old_cell' must have the same dtype, "
                r"got float32 and float64",
            ),
            BadInput(
                "cell_forward int",
                lambda: cell_forward(z(4, 9, dtype=torch.int32), z(9), z(4, 3)),
                r"lltm_op.cell_forward: argument 'gates' must be a floating-point tensor",
            ),
            BadInput(
                "cell_forward device",
                lambda: cell_forward(z(4, 9), z(9, device=other), z(4, 3)),
                rf"lltm_op.cell_forward: arguments 'gates' and 'bias' must be on the same device, "
                rf"got {this} and {other}",
            ),
            BadInput(
                "cell_backward grad shape",
                lambda: cell_backward(z(4, 2), None, z(4, 9), z(9), z(4, 3)),
                r"lltm_op.cell_backward: argument 'grad_h' must have shape \[4, 3\], got \[4, 2\]",
            ),
            BadInput(
                "cell_backward grad dtype",
                lambda: cell_backward(None, z(4, 3, dtype=torch.float16), z(4, 9), z(9), z(4, 3)),
                r"lltm_op.cell_backward: arguments 'gates' and 'grad_cell' must have the same dtype",
            ),
            BadInput(
                "cell_backward_from_new_cell new_cell shape",
                lambda: cell_backward_new(None, None, z(4, 9), z(9), z(4)),
                r"lltm_op.cell_backward_from_new_cell: argument 'new_cell' must have shape \[\*, \*\], "
                r"got \[4\]",
            ),
            BadInput(
                "cell_backward_from_new_cell gates shape",
                lambda: cell_backward_new(None, None, z(4, 8), z(9), z(4, 3)),
                r"lltm_op.cell_backward_from_new_cell: argument 'gates' must have shape \[4, 9\], got \[4, 8\]",
            ),
            # 3 * state must not wrap around in the shape checks.
            BadInput(
                "cell_forward state size overflow",
                lambda: cell_forward(z(0, 6), z(6), z(0, 2**62 + 2)),
                r"lltm_op.cell_forward: argument 'old_cell' has 4611686018427387906 columns \(the state "
                r"size\); 3 times that overflows int64",
            ),
            BadInput(
                "cell_backward_from_new_cell state size overflow",
                lambda: cell_backward_new(None, None, z(0, 6), z(6), z(0, 2**62 + 2)),
                r"lltm_op.cell_backward_from_new_cell: argument 'new_cell' has 4611686018427387906 columns",
            ),
            # A failed allocation names the op and the size asked for.
            BadInput(
                "cell_forward out of memory",
                lambda: cell_forward(z(1, 3).expand(2**50, 3), z(3), z(1, 1).expand(2**50, 1)),
                r"lltm_op.cell_forward: could not allocate an output, a float32 tensor of shape "
                r"\[1125899906842624, 1\] \(4503599627370496 bytes\) on (cpu|cuda:\d+) \(out of memory\?\)",
            ),
            BadInput(
                "cell_backward out of memory",
                lambda: cell_backward(None, None, z(1, 3).expand(2**50, 3), z(3), z(1, 1).expand(2**50, 1)),
                r"lltm_op.cell_backward: could not allocate an output, a float32 tensor of shape "
                r"\[1125899906842624, 3\] \(13510798882111488 bytes\)",
            ),
        ]


# -- accuracy of each dtype against float64 -------------------------------------------

ACCURACY = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(ACCURACY), ids=str)
@pytest.mark.parametrize("size", [(16, 32, 128), (7, 9, 13), (1, 20, 64)], ids=str)
def test_norm_error_against_float64(device, dtype, size):
    """||out - ref|| / ||ref|| of outputs and all five gradients."""
    device = need(device)
    gen = torch.Generator().manual_seed(hash((size, str(dtype))) % 2**31)
    args = [t.requires_grad_() for t in make_args(*size, dtype=dtype, device=device, generator=gen)]
    ref_args = [t.detach().double().requires_grad_() for t in args]
    grads = [torch.randn(size[0], size[2], dtype=torch.float64, generator=gen).to(device) for _ in range(2)]
    out = lltm(*args)
    ref = lltm_reference(*ref_args)
    torch.autograd.backward(out, [g.to(dtype) for g in grads])
    torch.autograd.backward(ref, grads)
    for name, o, r in zip(("new_h", "new_cell"), out, ref):
        assert o.dtype == dtype
        assert rel_err(o, r) <= ACCURACY[dtype], name
    for name, a, r in zip(("input", "weights", "bias", "old_h", "old_cell"), args, ref_args):
        assert a.grad.dtype == dtype
        assert rel_err(a.grad, r.grad) <= ACCURACY[dtype], f"grad of {name}"


# -- the cell kernels on special values ---------------------------------------------------


def cell_reference(gates: torch.Tensor, bias: torch.Tensor, old_cell: torch.Tensor):
    i, o, z = (gates + bias).chunk(3, dim=1)
    new_cell = old_cell + torch.nn.functional.elu(z) * torch.sigmoid(i)
    return torch.tanh(new_cell) * torch.sigmoid(o), new_cell


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_cell_special_values(device, dtype):
    """NaN, +-inf, -0.0, subnormals and huge pre-activations and cell states
    come out of the forward kernel as they do from torch's own ops (for the
    half types: from torch's ops in float32, rounded once at the end)."""
    device = need(device)
    special = torch.tensor(
        [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-40, -1e-40, 3e38, -3e38, 80.0, -80.0, 1.0, -1.0],
        dtype=torch.float64,
    ).to(dtype)
    n = special.numel()
    # Every special value in every gate and in old_cell, against every other.
    grid = torch.cartesian_prod(*[torch.arange(n)] * 4)
    gates = torch.cat([special[grid[:, k]].view(-1, 1) for k in range(3)], 1).to(device)
    old_cell = special[grid[:, 3]].view(-1, 1).to(device)
    bias = torch.zeros(3, dtype=dtype, device=device)
    got = cell_forward(gates, bias, old_cell)
    if dtype in HALF_DTYPES:
        want = [w.to(dtype) for w in cell_reference(gates.float(), bias.float(), old_cell.float())]
        tol = {"atol": 1e-2, "rtol": 1e-2}
    else:
        want = cell_reference(gates, bias, old_cell)
        tol = {"atol": 1e-6, "rtol": 1e-6}
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), equal_nan=True, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [0.01, 1.0, 5.0, 30.0])
def test_cell_float32_math_is_as_accurate_as_torch(device, scale):
    """The float32 kernels (vectorized exp/tanh/expm1 on the CPU) against
    float64, next to torch's own float32 ops on the same inputs."""
    device = need(device)
    gen = torch.Generator().manual_seed(int(scale * 100))
    n = 1 << 16
    gates, old_cell, gh, gc = (
        torch.randn(n, k, generator=gen) * s for k, s in ((24, scale), (8, scale), (8, 1.0), (8, 1.0))
    )
    bias = torch.randn(24, generator=gen) * 0.1
    args = [t.to(device) for t in (gates, bias, old_cell)]
    grads = [t.to(device) for t in (gh, gc)]
    f64 = [t.double() for t in args]
    got = [*cell_forward(*args), *cell_backward(*grads, *args)]
    want = [*cell_forward(*f64), *cell_backward(*(g.double() for g in grads), *f64)]
    torch_f32 = cell_reference(*args)
    torch_f64 = cell_reference(*f64)
    for name, g, w in zip(("new_h", "new_cell", "d_gates", "d_bias", "d_old_cell"), got, want):
        assert rel_err(g, w) < 1e-6, name
    for g, w, t, t64 in zip(got, want, torch_f32, torch_f64):  # forward outputs
        torch.testing.assert_close(w, t64)  # the float64 kernels are the reference math
        assert (g.double() - w).abs().max() <= 2 * (t.double() - t64).abs().max() + 1e-7


# -- gradients autograd only partly has ------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("use", ["h", "cell", "sum", "row-expanded"])
def test_partial_and_broadcast_output_gradients(device, dtype, use):
    """Only new_h or only new_cell used (the other gradient is None and is not
    materialized), and gradients that are expanded views (stride 0)."""
    device = need(device)
    args = [t.requires_grad_() for t in make_args(6, 5, 16, dtype=dtype, device=device)]
    ref_args = [t.detach().clone().requires_grad_() for t in args]

    def loss(h, c):
        if use == "h":
            return (h * h).sum()
        if use == "cell":
            return (c * c).sum()
        if use == "sum":
            return h.sum() + 2 * c.sum()  # grads: expanded scalars
        return (h * torch.arange(16.0, dtype=h.dtype, device=device)).sum() + c.sum(1).pow(2).sum()

    loss(*lltm(*args)).backward()
    loss(*lltm_reference(*ref_args)).backward()
    for a, r in zip(args, ref_args):
        torch.testing.assert_close(a.grad, r.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_reads_absent_gradients_as_zero(device):
    device = need(device)
    gates = torch.randn(3, 3 * 8, device=device, dtype=torch.float64)
    bias = torch.randn(3 * 8, device=device, dtype=torch.float64)
    old_cell = torch.randn(3, 8, device=device, dtype=torch.float64)
    g = torch.randn(3, 8, device=device, dtype=torch.float64)
    zero = torch.zeros_like(g)
    for gh, gc in [(g, None), (None, g), (None, None)]:
        got = cell_backward(gh, gc, gates, bias, old_cell)
        want = cell_backward(zero if gh is None else gh, zero if gc is None else gc, gates, bias, old_cell)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_without_grad(device):
    """Typical training: the data and the initial state need no gradient."""
    device = need(device)
    x, w, b, h, c = make_args(4, 3, 8, dtype=torch.float64, device=device)
    w.requires_grad_()
    b.requires_grad_()
    new_h, new_c = lltm(x, w, b, h, c)
    (new_h.sum() + new_c.pow(2).sum()).backward()
    w_ref, b_ref = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    rh, rc = lltm_reference(x, w_ref, b_ref, h, c)
    (rh.sum() + rc.pow(2).sum()).backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    torch.testing.assert_close(b.grad, b_ref.grad)
    assert x.grad is None and h.grad is None and c.grad is None
    with torch.no_grad():
        out = lltm(x, w, b, h, c)
    assert not out[0].requires_grad and not out[1].requires_grad
    torch.testing.assert_close(out[0], rh.detach())


# -- what backward keeps ---------------------------------------------------------------


def _saved_storages(fn, args):
    """{storage pointer: bytes} of the tensors autograd saves for backward
    in one call of fn, minus the arguments' own storages."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    for a in args:
        saved.pop(a.untyped_storage().data_ptr(), None)
    return saved, out


def test_saves_only_what_the_math_needs():
    """Saved for backward: the matrix product's operands (X = [old_h, input]
    and the weights, for dW and dX) and the cell kernel's gates (before the
    bias), the bias and its own output new_cell; no activations, and not
    old_cell, which a stateful loop may overwrite in place after the step."""
    batch, features, state = 4, 3, 8
    args = [t.requires_grad_() for t in make_args(batch, features, state)]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        new_h, new_c = lltm(*args)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == sorted(
        [
            (batch, state + features),  # X
            (state + features, 3 * state),  # weights.t() (a view, no copy)
            (batch, 3 * state),  # gates
            (3 * state,),  # bias (the caller's tensor)
            (batch, state),  # new_cell (the output itself)
        ]
    ), shapes
    for arg in (args[1], args[2]):  # weights, bias: no copies
        assert any(t.data_ptr() == arg.data_ptr() for t in saved)
    assert any(t.data_ptr() == new_c.data_ptr() for t in saved)
    assert not any(t.data_ptr() == args[4].data_ptr() for t in saved)  # not old_cell


def test_saves_less_than_the_pure_cell():
    """What a step keeps alive for backward, beyond its arguments: at most
    what the pure-PyTorch cell keeps (here about two thirds of it)."""
    args = [t.requires_grad_() for t in make_args(64, 32, 128)]
    ours, _ = _saved_storages(lltm, args)
    pure, _ = _saved_storages(lltm_reference, args)
    assert sum(ours.values()) <= 0.75 * sum(pure.values()), (sum(ours.values()), sum(pure.values()))


# -- a stateful loop that overwrites its state buffers in place ---------------------------


def _stateful_loop(fn, xs, weights, bias, steps):
    """An RNN loop with persistent state buffers: each step's new state is
    copied into them under no_grad (h.copy_(new_h); c.copy_(new_c)), and
    backward runs after all the steps."""
    batch, state = xs.shape[1], bias.shape[0] // 3
    h = torch.zeros(batch, state, dtype=xs.dtype, device=xs.device)
    c = torch.zeros_like(h)
    loss = 0
    for t in range(steps):
        new_h, new_c = fn(xs[t], weights, bias, h, c)
        loss = loss + (new_h * new_h).sum() + new_c.sum()
        with torch.no_grad():
            h.copy_(new_h)
            c.copy_(new_c)
    return loss


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_state_buffers_overwritten_in_place(device, dtype):
    device = need(device)
    steps = 5
    _, weights, bias, _, _ = make_args(3, 6, 8, dtype=dtype, device=device)
    xs = torch.randn(steps, 3, 6, dtype=dtype, device=device)
    grads = []
    for fn in (lltm, lltm_reference):
        leaves = [t.detach().clone().requires_grad_() for t in (xs, weights, bias)]
        loss = _stateful_loop(fn, *leaves, steps)
        grads.append(torch.autograd.grad(loss, leaves))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_stateful_loop_peak_memory_at_most_eager(dtype):
    """The same loop on the GPU: peak memory of forward + backward is at most
    that of the pure-PyTorch cell (eager)."""
    need("cuda")
    steps, batch, features, state = 16, 256, 128, 512
    _, weights, bias, _, _ = make_args(batch, features, state, dtype=dtype, device="cuda")
    xs = torch.randn(steps, batch, features, dtype=dtype, device="cuda")
    peaks, grads = [], []
    for fn in (lltm, lltm_reference):
        leaves = [t.detach().clone().requires_grad_() for t in (xs, weights, bias)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = _stateful_loop(fn, *leaves, steps)
        grads.append(torch.autograd.grad(loss, leaves))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del loss
    assert peaks[0] <= peaks[1], peaks
    for got, want in zip(*grads):
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 3e-2)


# -- double backward ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_penalty_through_a_sequence(device):
    """A gradient penalty (WGAN-GP style) through several steps: the gradient
    of ||d loss / d input|| with respect to the weights, against the pure
    cell, with no warning from autograd."""
    device = need(device)
    steps = 4
    _, weights, bias, h0, c0 = make_args(3, 5, 6, dtype=torch.float64, device=device)
    xs = torch.randn(steps, 3, 5, dtype=torch.float64, device=device)
    results = []
    for fn in (lltm, lltm_reference):
        x, w, b = (t.detach().clone().requires_grad_() for t in (xs, weights, bias))
        h, c = h0, c0
        for t in range(steps):
            h, c = fn(x[t], w, b, h, c)
        (dx,) = torch.autograd.grad(h.square().sum() + c.sum(), x, create_graph=True)
        penalty = (dx.norm() - 1) ** 2
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            results.append(torch.autograd.grad(penalty, (x, w, b)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_ops_are_differentiable(device):
    """cell_backward and cell_backward_from_new_cell, called directly, have
    right first and second derivatives (gradcheck, gradgradcheck, forward AD)."""
    device = need(device)
    gen = torch.Generator().manual_seed(7)
    (gates, bias, old_cell), (gh, gc) = random_cell_inputs(3, 4, gen)
    new_cell = cell_forward(gates, bias, old_cell)[1]
    for op, cell in ((cell_backward, old_cell), (cell_backward_new, new_cell)):
        args = tuple(t.to(device).requires_grad_() for t in (gh, gc, gates, bias, cell))
        assert torch.autograd.gradcheck(op, args, check_forward_ad=True, check_batched_grad=True)
        assert torch.autograd.gradgradcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_backward_from_new_cell_matches_backward_from_old_cell(device, dtype):
    device = need(device)
    gen = torch.Generator().manual_seed(3)
    for batch, state in [(1, 1), (5, 7), (70, 33), (3, 128)]:
        (gates, bias, old_cell), (gh, gc) = random_cell_inputs(batch, state, gen)
        gates, bias, old_cell, gh, gc = (t.to(device, dtype) for t in (gates, bias, old_cell, gh, gc))
        new_cell = cell_forward(gates, bias, old_cell)[1]
        for grads in [(gh, gc), (gh, None), (None, gc), (gh.sum(0, keepdim=True).expand_as(gh), None)]:
            got = cell_backward_new(*grads, gates, bias, new_cell)
            want = cell_backward(*grads, gates, bias, old_cell)
            for g, w in zip(got, want):
                if dtype == torch.bfloat16:
                    assert rel_err(g.cpu(), w.cpu()) < 2e-2
                else:
                    torch.testing.assert_close(g, w)


# -- export and autocast ----------------------------------------------------------------


@pytest.mark.parametrize("strict", [True, False])
def test_export_keeps_the_custom_op(strict):
    m = LLTM(5, 8)

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = m

        def forward(self, x, h, c):
            return self.cell(x, (h, c))

    x, h, c = torch.randn(3, 5), torch.randn(3, 8), torch.randn(3, 8)
    ep = torch.export.export(Step(), (x, h, c), strict=strict)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert cell_forward in targets
    for got, want in zip(ep.module()(x, h, c), lltm_reference(x, m.weights, m.bias, h, c)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_autocast(device):
    """Under autocast the matrix product runs in the low-precision dtype and
    the cell in the parameters' dtype; gradients reach every input."""
    device = need(device)
    args = [t.requires_grad_() for t in make_args(8, 16, 32, device=device)]
    ref_args = [t.detach().double().requires_grad_() for t in args]
    with torch.autocast(device, dtype=torch.bfloat16):
        new_h, new_c = lltm(*args)
    assert new_h.dtype == new_c.dtype == torch.float32
    (new_h.sum() + new_c.square().sum()).backward()
    ref_h, ref_c = lltm_reference(*ref_args)
    (ref_h.sum() + ref_c.square().sum()).backward()
    assert rel_err(new_h, ref_h) < 1e-2 and rel_err(new_c, ref_c) < 1e-2
    for a, r in zip(args, ref_args):
        assert a.grad.dtype == torch.float32
        assert rel_err(a.grad, r.grad) < 2e-2


AUTOCAST = [
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float16, marks=pytest.mark.cuda),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),
]


@pytest.mark.parametrize("device, dtype", AUTOCAST)
@pytest.mark.parametrize("state_dtype", ["float32", "autocast"])
def test_autocast_input_from_an_autocast_layer(device, dtype, state_dtype):
    """An LLTM fed by an autocast nn.Linear (so its input is in the autocast
    dtype) with float32 weights, and a float32 (or autocast-dtype) state: it
    runs, with the output and gradient dtypes of the pure-PyTorch cell under
    the same autocast, and its accuracy (against float64) or better."""
    device = need(device)
    torch.manual_seed(0)
    batch, features, state = 16, 32, 64
    layer = torch.nn.Linear(24, features, device=device)
    cell = LLTM(features, state, device=device)
    x = torch.randn(batch, 24, device=device)
    s_dtype = torch.float32 if state_dtype == "float32" else dtype
    h, c = (torch.randn(batch, state, device=device).to(s_dtype) for _ in range(2))
    outs, grads = [], []
    for fn in (lltm, lltm_reference):
        params = [p.detach().clone().requires_grad_() for p in (layer.weight, layer.bias, cell.weights, cell.bias)]
        with torch.autocast(device, dtype=dtype):
            inp = torch.nn.functional.linear(x, params[0], params[1])
            assert inp.dtype == dtype
            out = fn(inp, params[2], params[3], h, c)
            loss = out[0].float().square().sum() + out[1].float().sum()
        grads.append(torch.autograd.grad(loss, params))
        outs.append((inp.detach(), out))
    (inp, (new_h, new_c)), (_, (ref_h, ref_c)) = outs
    assert (new_h.dtype, new_c.dtype) == (ref_h.dtype, ref_c.dtype)
    exact = lltm_reference(*(t.detach().double() for t in (inp, cell.weights, cell.bias, h, c)))
    for got, pure, want in zip((new_h, new_c), (ref_h, ref_c), exact):
        assert rel_err(got, want) <= 1.25 * rel_err(pure, want) + 1e-6, (rel_err(got, want), rel_err(pure, want))
    for g, w in zip(*grads):
        assert g.dtype == w.dtype
        assert rel_err(g, w) < 5e-2


# -- empty work, shape arithmetic, allocation failures, module arguments ------------------


@pytest.mark.parametrize("device", DEVICES)
def test_empty_work_returns_at_once(device):
    """batch * state == 0: no time proportional to the batch (2^30 empty rows)."""
    device = need(device)
    rows = 2**30

    def z(*shape):
        return torch.zeros(*shape, device=device)

    start = time.perf_counter()
    cell_forward(z(rows, 0), z(0), z(rows, 0))
    for op in (cell_backward, cell_backward_new):
        op(z(rows, 0), z(rows, 0), z(rows, 0), z(0), z(rows, 0))
        op(None, None, z(rows, 0), z(0), z(rows, 0))
    args = [z(rows, 0).requires_grad_(), z(0, 0).requires_grad_(), z(0).requires_grad_(), z(rows, 0), z(rows, 0)]
    new_h, new_c = lltm(*args)
    (new_h.sum() + new_c.sum()).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    assert time.perf_counter() - start < 1.0
    # No rows, some state: the bias gradient, a sum over no rows, is zero.
    for op in (cell_backward, cell_backward_new):
        d_gates, d_bias, d_old = op(None, z(0, 5), z(0, 15), torch.ones(15, device=device), z(0, 5))
        assert d_gates.shape == (0, 15) and d_old.shape == (0, 5)
        assert torch.equal(d_bias, z(15))


def test_state_size_overflow_is_rejected_like_the_fake_kernel():
    """3 * state must not wrap around: the kernel rejects what the fake
    kernel (meta tensors, torch.compile) rejects, with the same message."""
    for device in ("cpu", "meta"):

        def z(*shape):
            return torch.zeros(*shape, device=device)

        for state in (2**62 + 2, 2**63 - 1, (2**63 - 1) // 3 + 1):
            with pytest.raises(
                RuntimeError,
                match=rf"^lltm_op.cell_forward: argument 'old_cell' has {state} "
                r"columns \(the state size\); 3 times that overflows int64$",
            ):
                cell_forward(z(0, 6), z(6), z(0, state))
            with pytest.raises(RuntimeError, match=rf"^lltm_op.cell_backward: argument 'old_cell' has {state}"):
                cell_backward(None, None, z(0, 6), z(6), z(0, state))
            with pytest.raises(
                RuntimeError,
                match=rf"^lltm_op.cell_backward_from_new_cell: argument 'new_cell' "
                rf"has {state}",
            ):
                cell_backward_new(None, None, z(0, 6), z(6), z(0, state))
        # The largest state size that fits is still checked as usual.
        state = (2**63 - 1) // 3
        with pytest.raises(RuntimeError, match=r"argument 'gates' must have shape \[0, 9223372036854775806\]"):
            cell_forward(z(0, 6), z(6), z(0, state))


def test_module_rejects_bad_sizes_like_nn_lstm():
    with pytest.raises(ValueError, match=r"^LLTM: state_size must be positive, got 0$"):
        LLTM(4, 0)
    with pytest.raises(ValueError, match=r"LLTM: state_size must be positive, got -3"):
        LLTM(4, -3)
    with pytest.raises(ValueError, match=r"LLTM: input_features must be non-negative, got -1"):
        LLTM(-1, 4)
    with pytest.raises(TypeError, match=r"LLTM: state_size must be an integer, got float"):
        LLTM(4, 2.5)
    with pytest.raises(TypeError, match=r"LLTM: input_features must be an integer, got bool"):
        LLTM(True, 4)
    m = LLTM(0, 1)  # no input features (as nn.Linear(0, n)) and one state unit: fine
    h, c = m(torch.zeros(2, 0), (torch.randn(2, 1), torch.randn(2, 1)))
    assert h.shape == c.shape == (2, 1)


# -- the module --------------------------------------------------------------------------


def test_module_matches_the_tutorial():
    torch.manual_seed(0)
    m = LLTM(32, 128)
    assert m.weights.shape == (384, 160) and m.bias.shape == (384,)
    assert sorted(dict(m.named_parameters())) == ["bias", "weights"]
    stdv = 1 / math.sqrt(128)
    for p in m.parameters():
        assert p.abs().max() <= stdv and p.abs().max() > 0.9 * stdv
    x, h, c = torch.randn(16, 32), torch.randn(16, 128), torch.randn(16, 128)
    new_h, new_c = m(x, (h, c))
    ref = lltm_reference(x, m.weights, m.bias, h, c)
    torch.testing.assert_close(new_h, ref[0])
    torch.testing.assert_close(new_c, ref[1])
    assert "input_features=32, state_size=128" in repr(m)
    m64 = LLTM(3, 4, dtype=torch.float64)
    assert m64.weights.dtype == torch.float64


@pytest.mark.parametrize("device", DEVICES)
def test_module_compiles_fullgraph_with_backward(device):
    device = need(device)
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = LLTM(6, 10).to(device)
    x, h, c = (torch.randn(3, n, device=device) for n in (6, 10, 10))

    def step(x, h, c):
        new_h, new_c = m(x, (h, c))
        return new_h.sum() + new_c.square().sum()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(x, h, c)
    loss.backward()
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    want_loss = step(x, h, c)
    want_loss.backward()
    torch.testing.assert_close(loss, want_loss)
    for g, p in zip(got, m.parameters()):
        torch.testing.assert_close(g, p.grad)


# -- training ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_short_training_loop_loss_falls(device):
    """An LLTM over a short sequence plus a linear read-out learns a fixed
    random regression target: the loss must fall well below its start."""
    device = need(device)
    torch.manual_seed(0)
    batch, features, state, steps = 32, 8, 16, 4
    cell = LLTM(features, state).to(device)
    head = torch.nn.Linear(state, 1).to(device)
    opt = torch.optim.Adam([*cell.parameters(), *head.parameters()], lr=1e-2)
    xs = torch.randn(steps, batch, features, device=device)
    target = torch.randn(batch, 1, device=device).clamp(-1.5, 1.5)
    losses = []
    for _ in range(150):
        h = torch.zeros(batch, state, device=device)
        c = torch.zeros(batch, state, device=device)
        for t in range(steps):
            h, c = cell(xs[t], (h, c))
        loss = torch.nn.functional.mse_loss(head(h), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])


# -- CUDA-only ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["cuda-graph", "reduce-overhead"])
def test_cuda_graphs_forward_backward_match_eager(mode, dtype):
    if not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    torch._dynamo.reset()
    device = "cuda"
    batch, features, state = 16, 32, 128
    static = [t.requires_grad_() for t in make_args(batch, features, state, dtype=dtype, device=device)]
    grads = [torch.randn(batch, state, device=device, dtype=dtype) for _ in range(2)]

    def step(*args):
        out = lltm(*args)
        torch.autograd.backward(out, grads)
        return out

    def eager(values):
        a = [v.detach().clone().requires_grad_() for v in values]
        out = step(*a)
        return [o.detach() for o in out] + [t.grad for t in a]

    def fresh():
        return make_args(batch, features, state, dtype=dtype, device=device)

    # Same kernels; cuBLAS may still pick another algorithm under capture.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}

    if mode == "cuda-graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                for t in static:
                    t.grad = None
                step(*static)
        torch.cuda.current_stream().wait_stream(side)
        for t in static:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(*static)
        for _ in range(3):
            values = fresh()
            with torch.no_grad():
                for s, v in zip(static, values):
                    s.copy_(v)
            graph.replay()
            torch.cuda.synchronize()
            got = [o.detach() for o in static_out] + [t.grad for t in static]
            for g, w in zip(got, eager(values)):
                torch.testing.assert_close(g, w, **tol)
    else:
        compiled = torch.compile(lambda *a: lltm(*a), mode="reduce-overhead", fullgraph=True)
        for _ in range(4):
            values = fresh()
            a = [v.clone().requires_grad_() for v in values]
            out = compiled(*a)
            torch.autograd.backward(out, grads)
            got = [o.detach().clone() for o in out] + [t.grad for t in a]
            for g, w in zip(got, eager(values)):
                torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_cuda_grid_stride_covers_large_inputs(dtype):
    """More vectors than one full wave of threads: each thread loops."""
    if not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    batch, state = 1100, 2048
    args, grads = random_cell_inputs(batch, state, torch.Generator().manual_seed(1))
    cuda_args, cuda_grads = ([t.to("cuda", dtype) for t in ts] for ts in (args, grads))
    got = [*cell_forward(*cuda_args), *cell_backward(*cuda_grads, *cuda_args)]
    # the reference sees the same (rounded) values as the kernels
    args, grads = ([t.cpu().double() for t in ts] for ts in (cuda_args, cuda_grads))
    want = [*cell_forward(*args), *cell_backward(*grads, *args)]
    limit = 1e-5 if dtype != torch.bfloat16 else 1e-2
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert rel_err(g.cpu(), w) <= limit


@pytest.mark.parametrize("state, rows_per_block", [(1, 256), (3, 64)])
def test_cuda_batch_beyond_65535_blocks_per_grid_dimension(state, rows_per_block):
    """A batch so long that one block per `rows_per_block` rows (the backward's
    block shape for this state size) would need more than 65535 blocks in
    grid y, and one thread per element more than 65535 blocks in x: the
    kernels stride over rows instead, and every row is right."""
    if not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    batch = 65535 * max(rows_per_block, -(-256 // state)) + 1001
    assert batch // rows_per_block > 65535 and batch * state // 256 > 65535
    args, grads = random_cell_inputs(batch, state, torch.Generator().manual_seed(state))
    want = [*cell_forward(*args), *cell_backward(*grads, *args)]
    cuda_args, cuda_grads = ([t.to("cuda", torch.float32) for t in ts] for ts in (args, grads))
    got = [*cell_forward(*cuda_args), *cell_backward(*cuda_grads, *cuda_args)]
    for name, g, w in zip(("new_h", "new_cell", "d_gates", "d_bias", "d_old_cell"), got, want):
        assert rel_err(g.cpu().double(), w) <= 1e-5, name
        # the last rows, past any 65535-block boundary, are written and right
        torch.testing.assert_close(g[-1001:].cpu().double(), w[-1001:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("state", [1, 5, 128, 130])
def test_cuda_backward_one_or_many_block_rows(dtype, state):
    """Small batches run the backward in one block row, which writes d_bias
    itself; larger ones sum per-block partials in a second kernel. Batches on
    both sides of that switch, for several block shapes, match the CPU."""
    if not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    gen = torch.Generator().manual_seed(state)
    limit = 1e-5 if dtype != torch.float16 else 1e-2
    for batch in (1, 7, 32, 33, 129, 257, 1025):
        args, grads = random_cell_inputs(batch, state, gen)
        want = cell_backward(*grads, *args)
        got = cell_backward(*(t.to("cuda", dtype) for t in (*grads, *args)))
        for name, g, w in zip(("d_gates", "d_bias", "d_old_cell"), got, want):
            assert rel_err(g.cpu().double(), w) <= limit, (batch, name)


def test_cuda_kernels_follow_the_current_stream():
    if not cuda_usable(BUILD_INFO):
        pytest.skip("needs a CUDA GPU and a CUDA build")
    args = make_args(64, 16, 256, device="cuda")
    want = lltm(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = lltm(*args)
        got = [g.clone() for g in got]
    torch.cuda.current_stream().wait_stream(side)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_cpu_only_build_rejects_cuda_clearly():
    if BUILD_INFO.get("cuda") is not None or not torch.cuda.is_available():
        pytest.skip("only for a CPU-only build in a CUDA torch")
    with pytest.raises(RuntimeError, match="CPU-only build"):
        lltm(*make_args(2, 3, 4, device="cuda"))


def test_version():
    # A CUDA build carries its toolkit as a local label: 0.6.43+cu130.
    label = "" if BUILD_INFO["variant"] == "cpu" else f"+{BUILD_INFO['variant']}"
    assert lltm_op.__version__ == "0.6.43" + label


def test_meta_tensors_get_the_ops_own_errors():
    """On meta tensors (no autocast state there) a wrong argument gets the
    same message as on the CPU, from the public function and the module."""
    x, w, b, h, c = (t.to("meta") for t in make_args(4, 3, 5))
    with pytest.raises(RuntimeError, match=r"^lltm_op\.lltm: argument 'bias' must have shape \[15\], got \[5\]$"):
        lltm(x, w, torch.zeros(5, device="meta"), h, c)
    new_h, new_c = LLTM(3, 5, device="meta")(x, (h, c))
    assert new_h.device.type == new_c.device.type == "meta" and new_h.shape == new_c.shape == (4, 5)
