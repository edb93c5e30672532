"""Run-time support of a built op package: load its binary, check the torch it
runs in, and the argument checks its fake kernels share with the C++ ones.

This file is copied from opscommon into every op package at build time (as
``<package>/_runtime.py``, with ``BUILD_INFO`` filled in), so an installed op
package needs nothing from opscommon at run time.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad

BUILD_INFO: dict = {}  # filled in at build time

FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
}


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch(info: dict = BUILD_INFO) -> None:
    """Raise ImportError when the running torch cannot load this binary."""
    pkg = info["package"]
    found = torch.__version__
    if _version_tuple(found) < _version_tuple(info["torch_min"]):
        raise ImportError(
            f"{pkg} {info['version']} is built on the LibTorch stable ABI for torch >= "
            f"{info['torch_min']} (built with torch {info['torch_built_with']}), but torch "
            f"{found} is installed. Install torch>={info['torch_min']}."
        )
    built_cuda = info.get("cuda")
    if built_cuda is not None:
        running = torch.version.cuda
        major = built_cuda.split(".")[0]
        what = cuda_build_name(info)
        if running is None:
            raise ImportError(
                f"{pkg} {info['version']} is {what}, but torch {found} is a CPU-only build. "
                f"Install a CUDA {major}.x build of torch, or the CPU build of {pkg}."
            )
        if running.split(".")[0] != major:
            raise ImportError(
                f"{pkg} {info['version']} is {what}, but torch {found} uses CUDA {running}. "
                f"Install a torch built for CUDA {major}.x, or rebuild {pkg} from source against this torch."
            )


def cuda_build_name(info: dict = BUILD_INFO) -> str:
    """How messages name a CUDA build: by the toolkit that compiled it (the
    version label's ``cu124``) and, where it differs, the CUDA of the torch
    it was built against (a CUDA 12.4 toolkit against torch's CUDA 12.8)."""
    built = info["cuda"]
    toolkit = info.get("cuda_toolkit") or built
    if toolkit == built:
        return f"a CUDA {toolkit} build"
    return f"a CUDA {toolkit} build (compiled with the CUDA {toolkit} toolkit against a torch built for CUDA {built})"


def library_file(package_dir: str, info: dict = BUILD_INFO) -> str:
    """The package's compiled library ``_C*.so``: what :func:`load_library`
    loads, and what a C++ program dlopens to register the ops."""
    candidates = sorted(glob.glob(os.path.join(package_dir, "_C*.so")))
    if not candidates:
        raise ImportError(f"{info['package']}: compiled library _C*.so not found in {package_dir}")
    return candidates[0]


def load_library(package_dir: str, info: dict = BUILD_INFO) -> str:
    """Check the torch version, then load ``_C*.so`` into torch's dispatcher."""
    check_torch(info)
    path = library_file(package_dir, info)
    torch.ops.load_library(path)
    return path


def command_line(package_dir: str, argv: list[str] | None = None, info: dict = BUILD_INFO) -> None:
    """``python -m <package> --library-path``: print the compiled library's
    path (a C++ program loads it to register the package's ops with torch's
    dispatcher; it needs no Python, only torch's libraries)."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {info['package']}", description=command_line.__doc__)
    parser.add_argument("--library-path", action="store_true", help="print the compiled library's path")
    args = parser.parse_args(argv)
    if not args.library_path:
        parser.print_help()
        return
    print(library_file(package_dir, info))


def register_missing_cuda(namespace: str, op_names: Iterable[str], info: dict = BUILD_INFO) -> None:
    """In a CPU-only build, give CUDA tensors a clear error instead of the
    dispatcher's bare NotImplementedError."""
    if info.get("cuda") is not None:
        return
    lib = torch.library.Library(namespace, "IMPL")
    for name in op_names:

        def _no_cuda(*args, _name=name, **kwargs):
            raise RuntimeError(
                f"{namespace}.{_name}: this {info['package']} {info['version']} is a CPU-only "
                f"build and got a CUDA tensor. Install the CUDA build, or rebuild from source "
                f"with nvcc present (OPS_CUDA=1)."
            )

        lib.impl(name, _no_cuda, "CUDA")
    # Keep the registration alive as long as the module.
    _KEEP_ALIVE.append(lib)


_KEEP_ALIVE: list = []


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _fail(message: str) -> None:
    raise RuntimeError(message)


def check_tensor(op: str, arg: str, t: object) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{arg}' must be a tensor, got {type(t).__name__}")


def check_dtype(op: str, arg: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        if tuple(allowed) == FLOATING_DTYPES:
            _fail(
                f"{op}: argument '{arg}' must be a floating-point tensor (float16, bfloat16, "
                f"float32 or float64), got {dtype_name(t.dtype)}"
            )
        names = ", ".join(dtype_name(d) for d in allowed)
        _fail(f"{op}: argument '{arg}' has dtype {dtype_name(t.dtype)}; supported dtypes are {names}")


def check_same_dtype(op: str, arg_a: str, a: torch.Tensor, arg_b: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        _fail(
            f"{op}: arguments '{arg_a}' and '{arg_b}' must have the same dtype, got "
            f"{dtype_name(a.dtype)} and {dtype_name(b.dtype)}"
        )


def _device_str(t: torch.Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else f"{t.device.type}:{t.device.index}"


def check_same_device(op: str, arg_a: str, a: torch.Tensor, arg_b: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        _fail(
            f"{op}: arguments '{arg_a}' and '{arg_b}' must be on the same device, got "
            f"{_device_str(a)} and {_device_str(b)}"
        )


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_same_shape(op: str, arg_a: str, a: torch.Tensor, arg_b: str, b: torch.Tensor) -> None:
    if tuple(a.shape) != tuple(b.shape):
        _fail(
            f"{op}: arguments '{arg_a}' and '{arg_b}' must have the same shape, got "
            f"{_shape_str(a.shape)} and {_shape_str(b.shape)}"
        )


def check_shape(op: str, arg: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    """``expected`` entries < 0 match any size."""
    ok = t.dim() == len(expected) and all(e < 0 or s == e for s, e in zip(t.shape, expected))
    if not ok:
        want = "[" + ", ".join("*" if e < 0 else str(e) for e in expected) + "]"
        _fail(f"{op}: argument '{arg}' must have shape {want}, got {_shape_str(t.shape)}")


# -- autograd --------------------------------------------------------------------
#
# torch.library.register_autograd gives a custom op reverse mode only: its
# generated autograd.Function has no jvp (forward AD and torch.func.jvp then
# drop the tangent silently) and no setup_context (torch.func.grad, vjp and
# jacrev refuse it). The ops register instead an Autograd kernel of their own
# that applies an autograd.Function with backward and jvp whenever a
# derivative may be asked for, and runs the plain kernel otherwise.
#
# Under torch.func transforms the dispatcher calls that kernel once per
# transform level, with that level's tensors, as it calls the derivative
# formulas of aten ops: the Function is then applied for that level alone
# (the single-level apply, which records it in the level's autograd graph or
# runs its jvp on the level's tangents), and its forward, calling the op
# below autograd, hands the op on to the next level. vmap levels use the
# op's vmap rule (torch.library.register_vmap).

_grad_enabled = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
functorch_active = torch._C._are_functorch_transforms_active
_single_level_allowed = torch._C._functorch.get_single_level_autograd_function_allowed
_set_single_level_allowed = torch._C._functorch.set_single_level_autograd_function_allowed
_set_fwd_grad_enabled = _forward_ad._set_fwd_grad_enabled
#: Runs the dispatcher below the Autograd keys (the one private name the
#: autograd design itself rests on: torch offers no public equivalent).
below_autograd = torch._C._AutoDispatchBelowAutograd
#: Below ADInplaceOrView too (an out= op's own version bump done by hand).
below_ad_inplace_or_view = torch._C._AutoDispatchBelowADInplaceOrView
#: Keysets a Python kernel registered with_keyset redispatches below itself.
after_autograd_keyset = torch._C._after_autograd_keyset
after_ad_inplace_or_view_keyset = torch._C._after_ADInplaceOrView_keyset


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for a device type
    autocast does not know (``meta``, where torch raises instead)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def forward_ad_active() -> bool:
    """A ``torch.autograd.forward_ad.dual_level`` is open: inputs may be dual
    tensors, whose tangents only an autograd.Function's jvp propagates."""
    return _forward_ad._current_level >= 0


def differentiating(*args: Any) -> bool:
    """Whether a call on ``args`` must go through autograd: grad mode on and
    an argument that requires grad, a forward-AD level open, or a torch.func
    transform (grad, vjp, jvp, jacrev, jacfwd, vmap, hessian) active."""
    return (_grad_enabled() and _any_requires_grad(*args)) or _forward_ad._current_level >= 0 or functorch_active()


class _CtxRecorder:
    """Stands in for ``ctx`` while a Function's forward runs under torch.func:
    records what the forward puts on it, for ``replay`` onto the real ctx."""

    _METHODS = (
        "save_for_backward",
        "save_for_forward",
        "set_materialize_grads",
        "mark_non_differentiable",
        "mark_dirty",
    )

    def __init__(self) -> None:
        object.__setattr__(self, "_calls", [])
        object.__setattr__(self, "_attrs", {})

    def __getattr__(self, name: str) -> Any:
        if name in _CtxRecorder._METHODS:
            return lambda *args: self._calls.append((name, args))
        try:
            return self._attrs[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._attrs[name] = value

    def replay(self, ctx: Any) -> None:
        for name, args in self._calls:
            getattr(ctx, name)(*args)
        for name, value in self._attrs.items():
            setattr(ctx, name, value)


# What level_forward records, until level_setup_context replays it: one
# stack per thread (a stack shared by threads would hand one thread's
# recorder to another's ctx when a thread switch falls between the two).
_LOCAL = threading.local()


def _recorded() -> list:
    try:
        return _LOCAL.recorded
    except AttributeError:
        _LOCAL.recorded = stack = []
        return stack


def register_autograd(qualname: str, function: type) -> None:
    """Make ``function`` (an autograd.Function taking the op's arguments in
    schema order, with ``forward`` calling the op below autograd, and
    ``backward`` and ``jvp``) the autograd of the custom op ``qualname``
    (``"ns::op"`` or ``"ns::op.overload"``). With nothing to differentiate,
    the kernel runs below autograd and records nothing."""
    ns, _, name = qualname.partition("::")
    opname, _, overload = name.partition(".")
    op = getattr(getattr(getattr(torch.ops, ns), opname), overload or "default")

    # Under torch.func: the Function at one level. Its forward hands the op
    # on to the lower levels with grad and forward grad on (the lower level
    # restores its own modes: off only where it was entered with them off),
    # as torch.func's own generated single-level Functions do.
    # torch >= 2.14 applies a Function under torch.func only when it has
    # setup_context: the forward runs on a recorder that setup_context
    # replays onto the real ctx (a stack: lower levels' applies nest inside).
    def level_forward(*args):
        recorder = _CtxRecorder()
        with torch.enable_grad(), _set_fwd_grad_enabled(True):
            out = function.forward(recorder, *args)
        _recorded().append(recorder)
        return out

    def level_setup_context(ctx, inputs, output):
        _recorded().pop().replay(ctx)

    # A single-level Function, as torch.func generates for autograd.Functions.
    level_function = type(
        function.__name__ + "Level",
        (torch.autograd.function._SingleLevelFunction,),
        {
            "forward": staticmethod(level_forward),
            "setup_context": staticmethod(level_setup_context),
            "backward": staticmethod(function.backward),
            "jvp": staticmethod(function.jvp),
        },
    )
    # The C++ apply (not Function.apply, which would start the transforms
    # over, from the top).
    single_level_apply = level_function.apply
    after_autograd = after_autograd_keyset
    fast_apply = function_apply(function)

    def autograd_kernel(keyset, *args):
        if functorch_active():
            # As torch.func's own rule for autograd.Functions does when it
            # applies its generated single-level Function.
            allowed = _single_level_allowed()
            _set_single_level_allowed(True)
            try:
                return single_level_apply(*args)
            finally:
                _set_single_level_allowed(allowed)
        if (_grad_enabled() and _any_requires_grad(*args)) or _forward_ad._current_level >= 0:
            return fast_apply(*args)
        with below_autograd():
            return op.redispatch(keyset & after_autograd, *args)

    lib = torch.library.Library(ns, "IMPL")
    lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    _KEEP_ALIVE.append(lib)


# -- fast paths of the public wrappers ------------------------------------------------
#
# A call of a small op is all host time, and most of that is Python: the
# OpOverload's __call__, Function.apply's pytree walk over its arguments.
# The helpers below take the shortest route through torch's *private* API,
# each with the public route as its fallback: a torch that lacks (or renames)
# a private name loses speed, never correctness. Setting the environment
# variable OPSCOMMON_PUBLIC_API_ONLY=1 before import forces the public routes
# everywhere (the tests run both). The ops carry no copies of this code.

PUBLIC_API_ONLY = os.environ.get("OPSCOMMON_PUBLIC_API_ONLY", "") not in ("", "0")


def op_callable(op: Any) -> Any:
    """The fastest callable that runs the OpOverload ``op`` through the
    dispatcher: its C++ entry point ``op._op`` (the dispatcher call without
    OpOverload.__call__'s Python frame), else ``op`` itself."""
    raw = None if PUBLIC_API_ONLY else getattr(op, "_op", None)
    return raw if callable(raw) else op


def function_apply(function: type) -> Any:
    """A callable equivalent to ``function.apply`` outside torch.func
    transforms: the C++ apply of
    ``torch._C._FunctionBase``, with the dead-wrapper unwrap
    ``Function.apply`` does per tensor instead of through pytree. Falls back
    to ``function.apply``. Callers must not use it while a torch.func
    transform is active (``functorch_active()``)."""
    if PUBLIC_API_ONLY:
        return function.apply
    try:
        base_apply = super(torch.autograd.Function, function).apply
        unwrap_if_dead = torch._C._functorch.unwrap_if_dead
    except AttributeError:
        return function.apply
    if base_apply is None or not callable(unwrap_if_dead):
        return function.apply
    Tensor = torch.Tensor

    def apply(*args):
        return base_apply(*[unwrap_if_dead(a) if isinstance(a, Tensor) else a for a in args])

    def apply1(x):
        return base_apply(unwrap_if_dead(x))

    def apply2(a, b):
        return base_apply(unwrap_if_dead(a), unwrap_if_dead(b))

    return {1: apply1, 2: apply2}.get(_arity(function), apply)


def _arity(function: type) -> int:
    import inspect

    try:
        params = list(inspect.signature(function.forward).parameters.values())
    except (TypeError, ValueError):
        return -1
    if not _has_setup_context(function):
        params = params[1:]  # ctx
    if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.default is not p.empty for p in params):
        return -1
    return len(params)


def below_autograd_caller(op: Any, arity: int = -1) -> Any:
    """A callable that runs the OpOverload ``op`` below the dispatcher's
    Autograd keys (the backend kernel, with no autograd recorded): what
    ``with below_autograd(): op(*args)`` does, for the no-grad path of the
    public wrappers and the forward of their autograd.Functions.

    The fast route marks the Autograd functionality key excluded in the
    dispatcher's thread-local state for the call (two C calls, where the
    guard object of the ``with`` costs a Python object and two method calls;
    about a third of a small op's overhead). An exclusion already in force
    (a caller below autograd, inference mode) is left as it was. The public
    fallback is the ``with`` guard. ``arity`` (1 or 2) gives a caller
    without ``*args`` packing. The callable's ``uses_private_api`` says
    which route it takes."""
    raw = op_callable(op)
    ctx = below_autograd
    if not PUBLIC_API_ONLY:
        try:
            key = torch._C.DispatchKey.AutogradFunctionality
            is_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
            set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded
        except AttributeError:
            pass
        else:

            def call(*args):
                if is_excluded(key):
                    return raw(*args)
                set_excluded(key, True)
                try:
                    return raw(*args)
                finally:
                    set_excluded(key, False)

            def call1(a):
                if is_excluded(key):
                    return raw(a)
                set_excluded(key, True)
                try:
                    return raw(a)
                finally:
                    set_excluded(key, False)

            def call2(a, b):
                if is_excluded(key):
                    return raw(a, b)
                set_excluded(key, True)
                try:
                    return raw(a, b)
                finally:
                    set_excluded(key, False)

            fast = {1: call1, 2: call2}.get(arity, call)
            fast.uses_private_api = True
            return fast

    def call_public(*args):
        with ctx():
            return raw(*args)

    call_public.uses_private_api = False
    return call_public


def _has_setup_context(function: type) -> bool:
    """A Function whose forward takes no ctx (setup_context style)."""
    base = torch.autograd.function._SingleLevelFunction.setup_context
    return getattr(function.setup_context, "__func__", function.setup_context) is not getattr(base, "__func__", base)


def using_private_api() -> bool:
    """Whether the fast paths above use torch's private API (False when
    OPSCOMMON_PUBLIC_API_ONLY is set)."""
    return not PUBLIC_API_ONLY


def register_composite_autograd(qualname: str, fn) -> None:
    """Give the custom op ``qualname`` the derivative of ``fn``, the same
    math in differentiable torch ops: when anything may be differentiated
    (see ``differentiating``) ``fn`` runs in place of the kernel, and
    autograd, forward AD and torch.func differentiate its torch ops; else the
    kernel runs below autograd."""
    ns, _, name = qualname.partition("::")
    opname, _, overload = name.partition(".")
    op = getattr(getattr(getattr(torch.ops, ns), opname), overload or "default")
    after_autograd = after_autograd_keyset

    def autograd_kernel(keyset, *args):
        if differentiating(*args):
            return fn(*args)
        with below_autograd():
            return op.redispatch(keyset & after_autograd, *args)

    lib = torch.library.Library(ns, "IMPL")
    lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    _KEEP_ALIVE.append(lib)
