"""The shared test contract every op package runs.

A package's test module subclasses :class:`OpContract`, describes its op
(inputs, the public call, a pure-PyTorch reference, bad inputs) and pytest
runs every ``test_*`` method below for it:

* numerics against the reference on fresh random inputs over dtypes, cases
  (shapes) and layouts (contiguous, transposed, strided, misaligned offset);
* gradients against the reference's autograd, and ``gradcheck`` in float64;
* ``torch.library.opcheck`` on the registered ops;
* ``torch.compile(fullgraph=True)`` with no graph break;
* bad input: a clear error naming the op and the argument;
* reliability: property tests (hypothesis) over shapes, layouts and special
  values, calls from several threads and CUDA streams, CUDA graph capture and
  replay, and no memory growth over repeated calls;
* every autograd feature right: forward-mode AD (dual tensors), double
  backward, and the torch.func transforms (grad, vjp, jvp, jacrev, jacfwd,
  hessian, vmap), each against the reference, with no warning; a feature an
  op refuses must raise an error naming the op (``refused_derivatives``);
* the same first derivatives through the registered ops alone: the public
  call exported with ``torch.export`` (what an exported program runs) under
  forward AD and torch.func;
* meta tensors through the public call and the module (``make_module``):
  the shapes and dtypes of a real call;
* autocast over a long chain of calls (``autocast_next_inputs``): the
  reference's dtypes and, against float64, no worse than twice its error;
* torch.func transforms from many threads with forced thread switches:
  the serial results (no state shared between threads).

CUDA variants carry the ``cuda`` marker and skip without a GPU or without a
CUDA build of the package.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LAYOUTS = ("contiguous", "transposed", "strided", "offset")
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


def cuda_usable(build_info: dict) -> bool:
    """A GPU is present and the package under test was built with CUDA."""
    return torch.cuda.is_available() and build_info.get("cuda") is not None


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor equal to ``t`` whose memory is laid out as ``layout``.

    ``transposed``: a permuted view (reversed dims); ``strided``: every other
    element of a buffer twice as long in the last dim; ``offset``: a view one
    element into its storage, so 16-byte alignment is lost.
    """
    if layout == "contiguous" or t.dim() == 0:
        return t.clone()
    if layout == "transposed":
        dims = list(range(t.dim()))[::-1]
        base = torch.empty([t.shape[d] for d in dims], dtype=t.dtype, device=t.device)
        view = base.permute(*dims)
    elif layout == "strided":
        base = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        view = base[..., ::2]
    elif layout == "offset":
        base = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = base[1:].view(t.shape)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    view.copy_(t)
    return view


@dataclass
class BadInput:
    """One rejected call: ``call()`` must raise ``error`` matching ``match``."""

    description: str
    call: Callable[[], Any]
    match: str
    error: type[BaseException] | tuple[type[BaseException], ...] = RuntimeError


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# -- reliability -----------------------------------------------------------------

SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"), -0.0, 1e-40, -1e-40, 3e38, -3e38)


def inject_special_values(t: torch.Tensor, draw: Callable, dtype: torch.dtype) -> torch.Tensor:
    """Overwrite a few random elements of a float tensor with special values
    (clamped to what ``dtype`` can hold: 3e38 is inf in float16)."""
    if not t.is_floating_point() or t.numel() == 0:
        return t
    t = t.clone()
    flat = t.view(-1)
    k = draw(st.integers(0, min(8, flat.numel())))
    for _ in range(k):
        index = draw(st.integers(0, flat.numel() - 1))
        flat[index] = draw(st.sampled_from(SPECIAL_VALUES))
    return t


class ReliabilityContract:
    """Mixin of OpContract: property, concurrency, stream, graph and memory tests."""

    def _property_check(self, device: str, data: st.DataObject) -> None:
        case = data.draw(self.case_strategy(), label="case")
        dtype = data.draw(st.sampled_from(list(self.dtypes)), label="dtype")
        layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
        inputs = self.make_inputs(case, dtype, device)
        if self.special_values:
            inputs = tuple(
                inject_special_values(t, data.draw, dtype) if isinstance(t, torch.Tensor) else t for t in inputs
            )
        laid = tuple(with_layout(t, layout) if isinstance(t, torch.Tensor) else t for t in inputs)
        out = self.call(*laid)
        ref = self.reference(*inputs)
        for o, r in zip(_as_tuple(out), _as_tuple(ref), strict=True):
            torch.testing.assert_close(o, r.to(o.dtype), equal_nan=True, **self.tolerance(dtype))

    @pytest.mark.parametrize("device", DEVICES)
    def test_property_matches_reference(self, device: str) -> None:
        device = self._device(device)
        examples = []

        @settings(
            max_examples=self.property_examples,
            deadline=None,
            derandomize=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(data=st.data())
        def check(data: st.DataObject) -> None:
            examples.append(1)
            self._property_check(device, data)

        check()
        print(f"{self.op_name}: {len(examples)} property examples on {device}")

    @pytest.mark.parametrize("device", DEVICES)
    def test_threads_match_serial_calls(self, device: str) -> None:
        device = self._device(device)
        dtype = torch.float32 if torch.float32 in self.dtypes else self.dtypes[0]
        jobs = [self.make_inputs(case, dtype, device) for case in list(self.cases) * 2]
        serial = [self.call(*inputs) for inputs in jobs]
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            threaded = list(pool.map(lambda inputs: self.call(*inputs), jobs))
        for a, b in zip(threaded, serial):
            for x, y in zip(_as_tuple(a), _as_tuple(b)):
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)

    @pytest.mark.cuda
    def test_side_streams_without_hidden_syncs(self) -> None:
        self._device("cuda")
        dtype = torch.float32 if torch.float32 in self.dtypes else self.dtypes[0]
        jobs = [self.make_inputs(case, dtype, "cuda") for case in self.cases]
        expected = [self.call(*inputs) for inputs in jobs]
        torch.cuda.synchronize()
        streams = [torch.cuda.Stream() for _ in range(3)]
        results = []
        # Any synchronizing call inside the op would raise in this mode.
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i, inputs in enumerate(jobs):
                stream = streams[i % len(streams)]
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    results.append(self.call(*inputs))
                    for t in _as_tuple(results[-1]):
                        t.record_stream(stream)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        for got, want in zip(results, expected):
            for x, y in zip(_as_tuple(got), _as_tuple(want)):
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)

    @pytest.mark.cuda
    def test_cuda_graph_replay_matches_eager(self) -> None:
        self._device("cuda")
        case = self.grad_cases[-1]
        static = self._grad_inputs(self.make_inputs(case, torch.float32, "cuda"))
        diff = [t for t in static if isinstance(t, torch.Tensor) and t.requires_grad]

        def step() -> tuple:
            outs = _as_tuple(self.call(*static))
            loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
            grads = torch.autograd.grad(loss, diff) if diff else ()
            return outs + tuple(grads)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up outside capture, as CUDA graphs require
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for _ in range(2):  # fresh data through the same graph
            fresh = self.make_inputs(case, torch.float32, "cuda")
            with torch.no_grad():
                for s, f in zip(static, fresh):
                    if isinstance(s, torch.Tensor):
                        s.copy_(f)
            graph.replay()
            torch.cuda.synchronize()
            eager = step()
            for x, y in zip(captured, eager, strict=True):
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)

    @pytest.mark.parametrize("device", DEVICES)
    def test_repeated_calls_do_not_grow_memory(self, device: str) -> None:
        device = self._device(device)
        case = max(self.grad_cases, key=lambda c: len(str(c)))
        inputs = self._grad_inputs(self.make_inputs(case, torch.float32, device))
        diff = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

        def step() -> None:
            outs = _as_tuple(self.call(*inputs))
            loss = sum(o.float().sum() for o in outs)
            if diff:
                torch.autograd.grad(loss, diff)

        for _ in range(200):
            step()
        gc.collect()
        rss0, gpu0 = _rss_bytes(), _gpu_bytes(device)
        for _ in range(3000):
            step()
        gc.collect()
        rss_growth, gpu_growth = _rss_bytes() - rss0, _gpu_bytes(device) - gpu0
        assert gpu_growth == 0, f"GPU memory grew by {gpu_growth} bytes over 3000 calls"
        # Allocator noise stays far below 32 MiB; a per-call leak does not.
        assert rss_growth < 32 * 2**20, f"RSS grew by {rss_growth / 2**20:.1f} MiB over 3000 calls"


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _gpu_bytes(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


# -- derivatives -------------------------------------------------------------------

#: The derivative features the contract checks (names for refused_derivatives).
DERIVATIVES = ("forward_ad", "jvp", "vjp", "grad", "jacrev", "jacfwd", "hessian", "vmap", "double_backward")


class DerivativeContract:
    """Mixin of OpContract: every autograd feature against the reference.

    Float64 inputs from ``grad_cases``; the differentiable arguments are
    ``grad_inputs``. The reference is ``derivative_reference`` (torch ops,
    differentiable in every mode). A feature listed in the op's
    ``refused_derivatives`` must instead raise a RuntimeError naming the op.
    UserWarnings (torch's "autograd kernel was not registered", or the
    vmap fallback's "performance drop") fail the tests.
    """

    #: Derivative features the op refuses with a clear error (see DERIVATIVES).
    refused_derivatives: ClassVar[Sequence[str]] = ()

    def derivative_reference(self, *inputs: Any) -> Any:
        """The reference for derivatives; by default ``reference``."""
        return self.reference(*inputs)

    # -- helpers --------------------------------------------------------------
    def _derivative_setup(self, case: Any, device: str):
        """(inputs, positions of the differentiable ones, f(*diff) -> outputs
        of the op, same for the reference)."""
        inputs = tuple(
            t.detach() if isinstance(t, torch.Tensor) else t for t in self.make_inputs(case, torch.float64, device)
        )
        pos = [i for i in self.grad_inputs if isinstance(inputs[i], torch.Tensor) and inputs[i].is_floating_point()]

        def bind(fn):
            def f(*diff):
                full = list(inputs)
                for i, d in zip(pos, diff):
                    full[i] = d
                return _as_tuple(fn(*full))

            return f

        return inputs, pos, bind(self.call), bind(self.derivative_reference)

    def _refused(self, feature: str, run: Callable[[], Any]) -> bool:
        if feature not in self.refused_derivatives:
            return False
        with pytest.raises(RuntimeError, match=self.op_name.split(".")[0]):
            run()
        return True

    @staticmethod
    def _close(got: Any, want: Any) -> None:
        got, want = _as_tuple(got), _as_tuple(want)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if isinstance(w, (tuple, list)):
                DerivativeContract._close(g, w)
                continue
            assert g is not None, "a derivative came back None"
            torch.testing.assert_close(g, w)

    # -- the tests ------------------------------------------------------------
    @pytest.mark.parametrize("device", DEVICES)
    def test_forward_ad_matches_reference(self, device: str) -> None:
        """torch.autograd.forward_ad: dual tensors in, the exact tangent out
        (never a dropped, None or zero tangent)."""
        device = self._device(device)
        for case in self.grad_cases:
            inputs, pos, f, ref = self._derivative_setup(case, device)
            tangents = [torch.randn_like(inputs[i]) for i in pos]

            def run(fn):
                with fwAD.dual_level():
                    duals = [fwAD.make_dual(inputs[i], t) for i, t in zip(pos, tangents)]
                    return [fwAD.unpack_dual(o).tangent for o in fn(*duals)]

            if self._refused("forward_ad", lambda: run(f)):
                return
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                got = run(f)
            self._close(got, run(ref))

    @pytest.mark.parametrize("device", DEVICES)
    def test_func_jvp_and_jacfwd_match_reference(self, device: str) -> None:
        device = self._device(device)
        for case in self.grad_cases:
            inputs, pos, f, ref = self._derivative_setup(case, device)
            primals = tuple(inputs[i] for i in pos)
            tangents = tuple(torch.randn_like(p) for p in primals)
            if self._refused("jvp", lambda: torch.func.jvp(f, primals, tangents)):
                return
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                out, tan = torch.func.jvp(f, primals, tangents)
                jac = torch.func.jacfwd(f, argnums=tuple(range(len(pos))))(*primals)
            want_out, want_tan = torch.func.jvp(ref, primals, tangents)
            self._close(out, want_out)
            self._close(tan, want_tan)
            self._close(jac, torch.func.jacrev(ref, argnums=tuple(range(len(pos))))(*primals))

    @pytest.mark.parametrize("device", DEVICES)
    def test_func_vjp_grad_and_jacrev_match_reference(self, device: str) -> None:
        device = self._device(device)
        for case in self.grad_cases:
            inputs, pos, f, ref = self._derivative_setup(case, device)
            primals = tuple(inputs[i] for i in pos)
            if self._refused("vjp", lambda: torch.func.vjp(f, *primals)[1](f(*primals))):
                return
            self._check_reverse_mode(f, ref, primals, tuple(range(len(pos))))

    def _check_reverse_mode(self, f, ref, primals, argnums) -> None:
        """torch.func's vjp, grad and jacrev of ``f`` equal those of ``ref``
        (UserWarnings are failures)."""
        cotangents = tuple(torch.randn_like(o) for o in ref(*primals))

        def loss(fn):
            return lambda *p: sum((o * w).sum() for o, w in zip(fn(*p), cotangents))

        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            got_vjp = torch.func.vjp(f, *primals)[1](cotangents)
            got_grad = torch.func.grad(loss(f), argnums=argnums)(*primals)
            got_jac = torch.func.jacrev(f, argnums=argnums)(*primals)
        self._close(got_vjp, torch.func.vjp(ref, *primals)[1](cotangents))
        self._close(got_grad, torch.func.grad(loss(ref), argnums=argnums)(*primals))
        self._close(got_jac, torch.func.jacrev(ref, argnums=argnums)(*primals))

    @pytest.mark.parametrize("device", DEVICES)
    def test_second_derivatives_match_reference(self, device: str) -> None:
        """Double backward (create_graph=True, a gradient penalty),
        gradgradcheck, and torch.func.hessian (forward over reverse) and
        grad of grad (reverse over reverse)."""
        device = self._device(device)
        for case in self.grad_cases:
            inputs, pos, f, ref = self._derivative_setup(case, device)
            primals = tuple(inputs[i] for i in pos)
            weights = tuple(torch.randn_like(o) for o in ref(*primals))

            def penalty_grads(fn):
                diff = [p.clone().requires_grad_() for p in primals]
                outs = fn(*diff)
                loss = sum((o * o * w).sum() for o, w in zip(outs, weights))
                grads = torch.autograd.grad(loss, diff, create_graph=True)
                penalty = sum((g * g).sum() for g in grads)
                return torch.autograd.grad(penalty, diff, allow_unused=True, materialize_grads=True)

            if self._refused("double_backward", lambda: penalty_grads(f)):
                return
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                got = penalty_grads(f)
            self._close(got, penalty_grads(ref))
            if self.numerically_differentiable:
                diff = tuple(p.clone().requires_grad_() for p in primals)
                assert torch.autograd.gradgradcheck(f, diff, eps=1e-6, atol=1e-5)
            if self._refused("hessian", lambda: torch.func.hessian(lambda *p: f(*p)[0].sum())(*primals)):
                return

            def scalar(fn):
                return lambda *p: sum((o.sin() * w).sum() for o, w in zip(fn(*p), weights))

            argnums = tuple(range(len(pos)))
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                got_h = torch.func.hessian(scalar(f), argnums=argnums)(*primals)
                got_gg = torch.func.grad(
                    lambda *p: sum(g.square().sum() for g in torch.func.grad(scalar(f), argnums=argnums)(*p)),
                    argnums=argnums,
                )(*primals)
            self._close(got_h, torch.func.hessian(scalar(ref), argnums=argnums)(*primals))
            self._close(
                got_gg,
                torch.func.grad(
                    lambda *p: sum(g.square().sum() for g in torch.func.grad(scalar(ref), argnums=argnums)(*p)),
                    argnums=argnums,
                )(*primals),
            )

    @pytest.mark.parametrize("device", DEVICES)
    def test_exported_program_derivatives_match_reference(self, device: str) -> None:
        """The public call exported with torch.export (non-strict): its graph
        calls the package's registered ops, and forward AD, torch.func.jvp,
        vjp, grad and jacrev of the exported program give the reference's
        first derivatives (or the refusal, naming the op, of a feature the op
        refuses): a registered op's own autograd is what an exported
        program, or any caller of torch.ops, gets."""
        device = self._device(device)
        namespace = self.op_name.split(".")[0]
        case = self.grad_cases[0]
        inputs, pos, _, ref = self._derivative_setup(case, device)
        call = self.call

        class Exported(torch.nn.Module):
            def forward(self, *args):
                return _as_tuple(call(*args))

        program = torch.export.export(Exported(), inputs, strict=False)
        targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        assert any(t.startswith(f"{namespace}.") for t in targets), f"no {namespace} op in the graph: {targets}"
        run = program.module()

        def f(*diff):
            full = list(inputs)
            for i, d in zip(pos, diff):
                full[i] = d
            return _as_tuple(run(*full))

        primals = tuple(inputs[i] for i in pos)
        tangents = tuple(torch.randn_like(p) for p in primals)
        argnums = tuple(range(len(pos)))

        def dual_tangents(fn):
            with fwAD.dual_level():
                duals = [fwAD.make_dual(p, t) for p, t in zip(primals, tangents)]
                return [fwAD.unpack_dual(o).tangent for o in fn(*duals)]

        if not self._refused("forward_ad", lambda: dual_tangents(f)):
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                got = dual_tangents(f)
            self._close(got, dual_tangents(ref))
        if not self._refused("jvp", lambda: torch.func.jvp(f, primals, tangents)):
            self._close(torch.func.jvp(f, primals, tangents), torch.func.jvp(ref, primals, tangents))
        if self._refused("vjp", lambda: torch.func.vjp(f, *primals)[1](f(*primals))):
            return
        self._check_reverse_mode(f, ref, primals, argnums)

    @pytest.mark.parametrize("device", DEVICES)
    def test_func_grad_from_threads_matches_serial(self, device: str) -> None:
        """torch.func.grad of the op from 8 threads at once, with the
        interpreter switching threads every microsecond: the serial results
        (state the op's autograd keeps between a Function's
        forward and its setup_context must be per thread)."""
        device = self._device(device)
        if "grad" in self.refused_derivatives:
            pytest.skip("the op refuses torch.func.grad")
        jobs = [self._derivative_setup(case, device) for case in list(self.grad_cases) * 4]

        def grads(job):
            inputs, pos, f, _ = job
            primals = tuple(inputs[i] for i in pos)
            return torch.func.grad(lambda *p: sum((o * o).sum() for o in f(*p)), argnums=tuple(range(len(pos))))(
                *primals
            )

        serial = [grads(job) for job in jobs]
        results: list = [None] * (8 * len(jobs))
        errors: list = []
        start = threading.Barrier(8)

        def worker(k: int) -> None:
            try:
                start.wait()
                for n in range(len(jobs)):
                    j = (n + k) % len(jobs)
                    results[k * len(jobs) + j] = grads(jobs[j])
            except BaseException as e:  # reported below
                errors.append(e)

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        try:
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            sys.setswitchinterval(interval)
        assert not errors, errors[0]
        for k in range(8):
            for j, want in enumerate(serial):
                for g, w in zip(results[k * len(jobs) + j], want):
                    torch.testing.assert_close(g, w)

    def test_autograd_state_is_per_thread(self) -> None:
        """What the package's runtime keeps between a Function's forward and
        its setup_context under torch.func (the recorded ctx calls) is one
        stack per thread: a stack shared by threads hands one thread's saved
        tensors to another's when a thread switch falls between the two
        (silently wrong gradients; too rare to catch by running threads)."""
        runtime = sys.modules[f"{self.build_info['package']}._runtime"]
        mine = runtime._recorded()
        seen: list = []

        def other() -> None:
            stack = runtime._recorded()
            stack.append("other thread")
            seen.append(stack)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert seen and seen[0] is not mine and "other thread" not in mine
        assert runtime._recorded() is mine

    @pytest.mark.parametrize("device", DEVICES)
    def test_func_vmap_matches_reference(self, device: str) -> None:
        """vmap over a batch of inputs (all batched, and only the first
        differentiable one batched), and vmap of grad (per-sample gradients)."""
        device = self._device(device)
        for case in self.grad_cases:
            samples = [self._derivative_setup(case, device) for _ in range(3)]
            _, pos, _, _ = samples[0]
            batched = [torch.stack([s[0][i] for s in samples]) for i in pos]
            f_all, ref_all = samples[0][2], samples[0][3]
            first_only = tuple(0 if k == 0 else None for k in range(len(pos)))
            unbatched = [b[0] for b in batched]
            if self._refused("vmap", lambda: torch.func.vmap(f_all)(*batched)):
                return
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)
                got = torch.func.vmap(f_all)(*batched)
                got_first = torch.func.vmap(f_all, in_dims=first_only)(batched[0], *unbatched[1:])
                per_sample = torch.func.vmap(torch.func.grad(lambda *p: sum(o.sum() for o in f_all(*p))))(*batched)
            want = [torch.stack(o) for o in zip(*(ref_all(*(b[n] for b in batched)) for n in range(3)))]
            want_first = [torch.stack(o) for o in zip(*(ref_all(batched[0][n], *unbatched[1:]) for n in range(3)))]
            self._close(got, want)
            self._close(got_first, want_first)
            self._close(
                per_sample, torch.func.vmap(torch.func.grad(lambda *p: sum(o.sum() for o in ref_all(*p))))(*batched)
            )


class OpContract(ReliabilityContract, DerivativeContract):
    """Base class of every op's contract tests; subclass it as ``Test...``."""

    #: "<namespace>.<op>" as it appears in error messages.
    op_name: ClassVar[str]
    #: The package's BUILD_INFO (from ``<package>._runtime``).
    build_info: ClassVar[dict]
    dtypes: ClassVar[Sequence[torch.dtype]] = FLOATING_DTYPES
    #: Opaque cases handed to make_inputs (shapes, usually).
    cases: ClassVar[Sequence[Any]] = ()
    #: Cases for gradients, gradcheck, opcheck and compile (small ones).
    grad_cases: ClassVar[Sequence[Any]] = ()
    #: Indices of the inputs that get gradients (float dtypes only).
    grad_inputs: ClassVar[Sequence[int]] = (0,)
    #: False for ops whose gradient is by definition not the numerical one
    #: (a straight-through estimator): the reference's autograd still checks it.
    numerically_differentiable: ClassVar[bool] = True

    # -- what a package provides --------------------------------------------
    def make_inputs(self, case: Any, dtype: torch.dtype, device: str) -> tuple:
        raise NotImplementedError

    def call(self, *inputs: Any) -> Any:
        """The public Python function under test."""
        raise NotImplementedError

    def reference(self, *inputs: Any) -> Any:
        """Pure-PyTorch reference, evaluated on the same inputs."""
        raise NotImplementedError

    def opcheck_targets(self) -> Sequence[Any]:
        """OpOverloads that opcheck validates with make_inputs' arguments."""
        return ()

    def bad_inputs(self, device: str) -> Sequence[BadInput]:
        return ()

    def tolerance(self, dtype: torch.dtype) -> dict:
        """assert_close keyword arguments for outputs of ``dtype``."""
        return {}

    #: Property tests: how many hypothesis examples per device.
    property_examples: ClassVar[int] = 60
    #: Whether inputs may hold NaN, +-inf, -0.0, subnormals and huge values
    #: (ops whose reference propagates them elementwise).
    special_values: ClassVar[bool] = True

    def case_strategy(self) -> st.SearchStrategy:
        """Cases for the property tests; by default the listed cases."""
        return st.sampled_from(list(self.cases))

    def make_module(self, case: Any, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, tuple] | None:
        """The package's nn.Module built on ``device`` (``device=`` and
        ``dtype=`` of its constructor) and the arguments of a call of it on
        that device, for ``case``; None when the package has no module."""
        return None

    #: The case and the number of chained calls of the autocast test; None:
    #: the last of ``grad_cases``.
    autocast_case: ClassVar[Any] = None
    autocast_calls: ClassVar[int] = 100

    def autocast_next_inputs(self, inputs: tuple, outputs: tuple) -> tuple:
        """The inputs of the next call of a chain (the autocast test): by
        default the first output takes the first input's place (an
        accumulation for ops of that shape); recurrent ops pass their state on."""
        return (outputs[0], *inputs[1:])

    # -- helpers --------------------------------------------------------------
    def _device(self, device: str) -> str:
        if device == "cuda" and not cuda_usable(self.build_info):
            pytest.skip("needs a CUDA GPU and a CUDA build of the package")
        return device

    def compare(self, out: Any, ref: Any, dtype: torch.dtype) -> None:
        for o, r in zip(_as_tuple(out), _as_tuple(ref), strict=True):
            assert o.shape == r.shape, (o.shape, r.shape)
            assert o.dtype == r.dtype or r.dtype == torch.float64, (o.dtype, r.dtype)
            torch.testing.assert_close(o, r.to(o.dtype), **self.tolerance(dtype))

    def _grad_inputs(self, inputs: tuple) -> tuple:
        return tuple(
            t.detach().requires_grad_(i in self.grad_inputs and t.is_floating_point())
            if isinstance(t, torch.Tensor)
            else t
            for i, t in enumerate(inputs)
        )

    # -- the contract -----------------------------------------------------------
    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("device", DEVICES)
    def test_matches_reference(self, device: str, layout: str) -> None:
        device = self._device(device)
        for dtype in self.dtypes:
            for case in self.cases:
                inputs = self.make_inputs(case, dtype, device)
                laid = tuple(with_layout(t, layout) if isinstance(t, torch.Tensor) else t for t in inputs)
                out = self.call(*laid)
                self.compare(out, self.reference(*inputs), dtype)
                # The op must not write to its inputs.
                for a, b in zip(inputs, laid):
                    if isinstance(a, torch.Tensor):
                        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    @pytest.mark.parametrize("device", DEVICES)
    def test_gradients_match_reference(self, device: str) -> None:
        device = self._device(device)
        for dtype in (torch.float32, torch.float64):
            if dtype not in self.dtypes:
                continue
            for case in self.grad_cases:
                inputs = self._grad_inputs(self.make_inputs(case, dtype, device))
                ref_inputs = self._grad_inputs(inputs)
                outs = _as_tuple(self.call(*inputs))
                refs = _as_tuple(self.reference(*ref_inputs))
                grads_out = [torch.randn_like(o) for o in outs]
                diff = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                ref_diff = [t for t in ref_inputs if isinstance(t, torch.Tensor) and t.requires_grad]
                got = torch.autograd.grad(outs, diff, grads_out, allow_unused=True)
                want = torch.autograd.grad(refs, ref_diff, grads_out, allow_unused=True)
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w, **self.tolerance(dtype))

    @pytest.mark.parametrize("device", DEVICES)
    def test_gradcheck(self, device: str) -> None:
        device = self._device(device)
        if not self.numerically_differentiable:
            pytest.skip("straight-through gradient: checked against the reference instead")
        for case in self.grad_cases:
            inputs = self._grad_inputs(self.make_inputs(case, torch.float64, device))
            assert torch.autograd.gradcheck(self.call, inputs, eps=1e-6, atol=1e-5)

    @pytest.mark.parametrize("device", DEVICES)
    def test_opcheck(self, device: str) -> None:
        device = self._device(device)
        targets = self.opcheck_targets()
        assert targets, "the contract needs at least one op to opcheck"
        for target in targets:
            for dtype in (torch.float32, torch.float64):
                for case in self.grad_cases:
                    args = self._grad_inputs(self.make_inputs(case, dtype, device))
                    torch.library.opcheck(target, args)

    @pytest.mark.parametrize("device", DEVICES)
    def test_compile_fullgraph(self, device: str) -> None:
        device = self._device(device)
        torch._dynamo.reset()
        compiled = torch.compile(self.call, fullgraph=True, dynamic=False)
        for case in self.grad_cases[:2]:
            inputs = self._grad_inputs(self.make_inputs(case, torch.float32, device))
            out = compiled(*inputs)
            self.compare(out, self.reference(*inputs), torch.float32)
            sum(o.float().sum() for o in _as_tuple(out)).backward()

    @pytest.mark.parametrize("device", DEVICES)
    def test_autograd_records_as_before_after_calls(self, device: str) -> None:
        """The ops' no-grad path turns autograd off in the dispatcher's
        thread-local state for the call alone: after a rejected call autograd
        records again, and inside inference mode it stays off."""
        device = self._device(device)
        probe = torch.ones(2, requires_grad=True)
        key = torch._C.DispatchKey.AutogradFunctionality

        def records() -> bool:
            return (probe * 2).requires_grad and not torch._C._dispatch_tls_is_dispatch_key_excluded(key)

        for bad in self.bad_inputs(device):
            with pytest.raises(bad.error):
                bad.call()
            assert records(), f"autograd stopped recording after {bad.match!r}"
        inputs = self.make_inputs(self.grad_cases[0], torch.float32, device)
        self.call(*inputs)
        assert records()
        with torch.inference_mode():
            self.compare(self.call(*inputs), self.reference(*inputs), torch.float32)
            assert torch._C._dispatch_tls_is_dispatch_key_excluded(key), (
                "a call inside inference mode turned the Autograd keys back on"
            )
        assert records()

    def test_meta_tensors_give_the_shapes_of_a_real_call(self) -> None:
        """The public call and the module on meta tensors (shape inference,
        models built with device="meta"): the shapes and dtypes of the same
        call on the CPU, with no device-specific machinery (autocast state)
        in the way."""
        for dtype in (torch.float32, self.dtypes[0]):
            for case in self.cases:
                inputs = self.make_inputs(case, dtype, "cpu")
                metas = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
                want, got = _as_tuple(self.call(*inputs)), _as_tuple(self.call(*metas))
                for g, w in zip(got, want, strict=True):
                    assert g.device.type == "meta" and g.shape == w.shape and g.dtype == w.dtype, (g, w.shape)
        for case in self.grad_cases:
            built = self.make_module(case, torch.float32, "meta")
            if built is None:
                return
            module, args = built
            assert all(p.device.type == "meta" for p in module.parameters())
            cpu_module, cpu_args = self.make_module(case, torch.float32, "cpu")
            got, want = _flat_tensors(module(*args)), _flat_tensors(cpu_module(*cpu_args))
            for g, w in zip(got, want, strict=True):
                assert g.device.type == "meta" and g.shape == w.shape and g.dtype == w.dtype, (g, w.shape)

    @pytest.mark.parametrize("device", DEVICES)
    def test_autocast_chain_keeps_the_reference_precision(self, device: str) -> None:
        """A long chain of calls (``autocast_next_inputs``) under autocast
        from float32 inputs: the dtypes of the same chain of the reference
        under autocast, and an error against the chain in float64 within
        twice the reference's for most of 7 random starts (an op that kept a
        state or an accumulation in the autocast dtype where the reference
        keeps float32 fails on all of them: for lltm_sequence that was 13x at
        50 steps). Most, not all: a long chain amplifies rounding
        chaotically, and two chains that both keep float32 but round in
        different places differed by 2.5x or more on about 1 start in 20."""
        device = self._device(device)
        if torch.float32 not in self.dtypes:
            pytest.skip("no float32")
        low = torch.bfloat16 if device == "cpu" else torch.float16
        case = self.autocast_case if self.autocast_case is not None else self.grad_cases[-1]

        def chain(fn, inputs, autocast: bool):
            with torch.autocast(device, dtype=low, enabled=autocast):
                for _ in range(self.autocast_calls):
                    outputs = _as_tuple(fn(*inputs))
                    inputs = self.autocast_next_inputs(inputs, outputs)
            return outputs

        starts = 7
        errors: list[list[tuple[float, float]]] = []
        for _ in range(starts):
            start = self.make_inputs(case, torch.float32, device)
            got = chain(self.call, start, True)
            want = chain(self.reference, start, True)
            exact = chain(self.reference, tuple(t.double() if isinstance(t, torch.Tensor) else t for t in start), False)
            row = []
            for g, w, x in zip(got, want, exact, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype)
                norm = x.double().norm().item() or 1.0
                row.append(
                    ((g.double() - x.double()).norm().item() / norm, (w.double() - x.double()).norm().item() / norm)
                )
            errors.append(row)
        for k in range(len(errors[0])):
            pairs = [row[k] for row in errors]
            worse = [p for p in pairs if p[0] > 2 * p[1] + 1e-6]
            assert len(worse) <= starts // 2, (
                f"{self.op_name} under autocast, output {k}: relative error against float64 after "
                f"{self.autocast_calls} chained calls more than twice the reference's on {len(worse)} of {starts} "
                f"random starts: " + ", ".join(f"{g:.2e} vs {r:.2e}" for g, r in pairs)
            )

    @pytest.mark.parametrize("device", DEVICES)
    def test_bad_input_is_a_clear_error(self, device: str) -> None:
        device = self._device(device)
        cases = list(self.bad_inputs(device))
        assert cases, "the contract needs bad-input cases"
        for bad in cases:
            with pytest.raises(bad.error, match=bad.match):
                bad.call()


def _flat_tensors(x: Any) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _flat_tensors(item)]
    return []


def run_with_public_api_only(code: str, timeout: float = 600) -> None:
    """Run ``code`` in a fresh interpreter with OPSCOMMON_PUBLIC_API_ONLY=1,
    where the op packages' fast paths take their public-API fallbacks (what a
    torch without the private names they use would get); fail with its
    output if it fails. ``code`` should import the op package, check
    ``_runtime.using_private_api()`` is False and exercise the op."""
    env = dict(os.environ, OPSCOMMON_PUBLIC_API_ONLY="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"public-API fallback failed:\n{result.stdout}\n{result.stderr}"


class DeployContract:
    """The deployment checks every op package runs (``tests/test_deploy_<op>.py``
    subclasses this): a model that calls the op, exported with dynamic shapes
    and compiled by AOTInductor into a ``.pt2``, runs in a fresh Python that
    imports only torch and the op package, and from the C++ runner with no
    Python in its process (:mod:`opscommon.deploy`); outputs equal eager's.

    A subclass sets ``module`` (the import name), ``build_info`` (its
    ``_runtime.BUILD_INFO``) and ``dynamic_shapes``, and defines
    ``make_model()``, ``example_inputs(device)`` (what the export sees) and
    ``sample_inputs(device)`` (at least two input lists of other sizes: the
    first runs in Python, the rest from C++)."""

    module: ClassVar[str]
    build_info: ClassVar[dict]
    dynamic_shapes: ClassVar[Any]

    def make_model(self) -> torch.nn.Module:
        raise NotImplementedError

    def example_inputs(self, device: str) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def sample_inputs(self, device: str) -> list[list[torch.Tensor]]:
        raise NotImplementedError

    def eager(self, model: torch.nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            out = model(*inputs)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    @pytest.fixture(scope="class", params=DEVICES)
    def deployed(self, request, tmp_path_factory):
        """(device, model, .pt2 path): exported once per device for the class."""
        from . import deploy

        device = request.param
        if device == "cuda" and not cuda_usable(self.build_info):
            pytest.skip("needs a CUDA GPU and a CUDA build of the package")
        torch.manual_seed(0)
        model = self.make_model().to(device).eval()
        path = tmp_path_factory.mktemp(f"deploy-{device}") / "model.pt2"
        return device, model, deploy.export_and_package(model, self.example_inputs(device), self.dynamic_shapes, path)

    @pytest.fixture(scope="class")
    def runner(self):
        from . import deploy

        return deploy.build_runner()

    def test_library_path_prints_the_compiled_library(self) -> None:
        import importlib

        from . import deploy

        path = deploy.library_path(self.module)
        assert os.path.basename(path).startswith("_C") and path.endswith(".so")
        assert os.path.dirname(path) == os.path.dirname(importlib.import_module(self.module).__file__)

    def skip_if_torch_cannot_load(self, device: str) -> None:
        """Skip, with torch's failure, where torch cannot load even a package
        of its own ops in Python (:func:`opscommon.deploy.torch_cannot_load_packages`)."""
        from . import deploy

        problem = deploy.torch_cannot_load_packages(device)
        if problem is not None:
            last = [line for line in problem.strip().splitlines() if line.strip()][-3:]
            pytest.skip(
                f"torch {torch.__version__} cannot load a {device} .pt2 of its own ops (no custom op) "
                f"in Python here: {' | '.join(last)}"
            )

    def test_pt2_runs_in_a_fresh_python(self, deployed) -> None:
        from . import deploy

        device, model, package = deployed
        inputs = self.sample_inputs(device)[0]
        try:
            outs = deploy.run_in_fresh_python(package, self.module, inputs, device)
        except RuntimeError:
            # A failure is the op's unless torch fails without it too.
            self.skip_if_torch_cannot_load(device)
            raise
        deploy.assert_same_outputs(outs, self.eager(model, inputs), device)

    def test_pt2_runs_from_cpp_without_python(self, deployed, runner) -> None:
        from . import deploy

        device, model, package = deployed
        for inputs in self.sample_inputs(device)[1:]:
            outs, log = deploy.run_in_cpp(runner, package, [deploy.library_path(self.module)], inputs, device)
            assert "no libpython mapped" in log
            deploy.assert_same_outputs(outs, self.eager(model, inputs), device)

    def test_cpp_runner_needs_the_op_library(self, deployed, runner) -> None:
        """Without the op's library the package cannot run: the test above
        really exercises the library loaded from the command line."""
        from . import deploy

        device, _, package = deployed
        with pytest.raises(RuntimeError, match=self.module):
            deploy.run_in_cpp(runner, package, [], self.sample_inputs(device)[1], device)

    def test_cpp_runner_refuses_a_process_with_libpython(self, deployed, runner) -> None:
        """The runner's own check fires when libpython is in its process."""
        from . import deploy

        libpython = deploy.libpython_path()
        if libpython is None:
            pytest.skip("this Python has no shared libpython to preload")
        device, _, package = deployed
        libraries = [deploy.library_path(self.module)]
        with pytest.raises(RuntimeError, match=r"libpython is mapped into the runner \(exit 3\)") as err:
            deploy.run_in_cpp(
                runner, package, libraries, self.sample_inputs(device)[1], device, extra_env={"LD_PRELOAD": libpython}
            )
        assert "libpython is mapped" in str(err.value).split("\n", 1)[1]
