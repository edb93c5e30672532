"""The shared test contract every op package runs.

A package's test module subclasses :class:`OpContract`, describes its op
(inputs, the public call, a pure-PyTorch reference, bad inputs) and pytest
runs every ``test_*`` method below for it:

* numerics against the reference on fresh random inputs over dtypes, cases
  (shapes) and layouts (contiguous, transposed, strided, misaligned offset);
* gradients against the reference's autograd, and ``gradcheck`` in float64;
* ``torch.library.opcheck`` on the registered ops;
* ``torch.compile(fullgraph=True)`` with no graph break;
* bad input: a clear error naming the op and the argument.

CUDA variants carry the ``cuda`` marker and skip without a GPU or without a
CUDA build of the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import pytest
import torch

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


class OpContract:
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
    def test_bad_input_is_a_clear_error(self, device: str) -> None:
        device = self._device(device)
        cases = list(self.bad_inputs(device))
        assert cases, "the contract needs bad-input cases"
        for bad in cases:
            with pytest.raises(bad.error, match=bad.match):
                bad.call()
