"""Build helper that every op package's ``setup.py`` calls.

It decides, explicitly and loudly, whether to build the CPU or the CUDA
variant, and returns a stable-ABI extension in a wheel for every Python:

* ``OPS_CUDA=auto`` (default): CUDA when nvcc and a CUDA torch are both
  present, CPU otherwise; the choice and its reason are printed.
* ``OPS_CUDA=1``: CUDA or a :class:`BuildConfigError` that says what to do
  (no nvcc, a CPU-only torch, a CUDA major that differs from torch's).
* ``OPS_CUDA=0``: CPU only.

``TORCH_CUDA_ARCH_LIST`` defaults to :data:`DEFAULT_CUDA_ARCH_LIST` (torch
would otherwise probe the GPUs, and fail with no GPU); ``MAX_JOBS`` is passed
to ninja by torch's ``BuildExtension``, and is also how many architectures one
nvcc compiles at once (:func:`nvcc_threads`).

Portability: every C++ file is compiled so that the binary needs no glibc
symbol newer than 2.28 (the manylinux_2_28 floor): see
``include/opscommon/glibc_compat``. A CUDA build's version carries the
toolkit as a local label (``0.1.0+cu130``), so CPU and CUDA wheels never share
a file name.

Wheel tag: ``py3-none-<platform>``, not ``cp310-abi3``. The library calls no
Python C API (torch loads it with ``torch.ops.load_library``; it is never
imported as a module), so one wheel serves every CPython from
``requires-python`` on, free-threaded builds (3.13t, 3.14t) included, which
an abi3 wheel cannot. The release checks hold every wheel to that: a binary
with an undefined Python symbol fails them.

Cross-compilation (a wheel for another CPU, e.g. aarch64 built on x86_64):
``OPS_CROSS_TORCH`` names the ``torch`` folder of the target platform's torch
wheel (its ``include/`` and ``lib/``), ``OPS_CROSS_PLAT`` the wheel platform
(``linux_aarch64``), and ``CXX`` (with ``CC``, ``LDSHARED``, ``LDCXXSHARED``)
a compiler for that CPU; see :func:`cross_target`. The installed torch only
runs the build machinery (a CPU-only one will do): the CUDA version the
variant is checked against is the target torch's. A CUDA cross build needs
a ``CUDA_HOME`` whose ``bin/`` runs here (nvcc, given the cross compiler as
its host compiler) and whose ``include/`` and ``lib/`` (and
``targets/<dir>/``, where nvcc looks for them) are the target CPU's. An op's sdist carries this helper and the headers
(:func:`setup_kwargs` adds them), so it builds with nothing but public
packages.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import TORCH_TARGET_VERSION, get_include

CUDA_ENV = "OPS_CUDA"
# T4 (7.5) to consumer Blackwell (12.0), PTX for newer GPUs; H100/H200 as
# sm_90a (9.0a: its SASS runs on compute capability 9.0, the only sm_90
# GPUs, and has warpgroup MMA); matrix.toml's cuda.arch_list is the same
# (tools/tests/test_single_source.py holds them together).
DEFAULT_CUDA_ARCH_LIST = "7.5;8.0;9.0a;10.0;12.0+PTX"
# Py_LIMITED_API of a build on a CPython that has a limited API (not the
# free-threaded ones): should a source ever include Python.h, it sees only
# the stable ABI of Python >= 3.10 (requires-python). The sources use none.
LIMITED_API_HEX = "0x030A0000"
# The wheel's Python and ABI tags (see the module docstring): any Python 3,
# no Python ABI; requires-python (>= 3.10) keeps older ones out.
WHEEL_PYTHON_TAG = "py3"
WHEEL_ABI_TAG = "none"

# The grammar of TORCH_CUDA_ARCH_LIST, as torch.utils.cpp_extension's
# _get_cuda_arch_flags reads it (torch 2.13): "native", or entries separated
# by ';' or single spaces, each a supported compute capability with an
# optional "+PTX", where the named architectures expand first, by string
# replacement (combined names such as "Ampere+Tegra" before single ones).
# The torch being built against has the last word (validate_arch_list asks
# it); these tables name the bad entries, and decide where torch cannot be asked.
_NAMED_ARCHES = {
    "Kepler+Tesla": "3.7",
    "Kepler": "3.5+PTX",
    "Maxwell+Tegra": "5.3",
    "Maxwell": "5.0;5.2+PTX",
    "Pascal": "6.0;6.1+PTX",
    "Volta+Tegra": "7.2",
    "Volta": "7.0+PTX",
    "Turing": "7.5+PTX",
    "Ampere+Tegra": "8.7",
    "Ampere": "8.0;8.6+PTX",
    "Ada": "8.9+PTX",
    "Hopper": "9.0+PTX",
    "Blackwell+Tegra": "11.0",
    "Blackwell": "10.0;10.3;12.0;12.1+PTX",
}
_SUPPORTED_ARCHES = (
    "3.5 3.7 5.0 5.2 5.3 6.0 6.1 6.2 7.0 7.2 7.5 8.0 8.6 8.7 8.9 9.0 9.0a "
    "10.0 10.0a 11.0 11.0a 10.3 10.3a 12.0 12.0a 12.1 12.1a"
).split()
_VALID_ARCHES = frozenset(_SUPPORTED_ARCHES + [a + "+PTX" for a in _SUPPORTED_ARCHES])
NATIVE = "native"


class BuildConfigError(RuntimeError):
    """The requested build cannot be made; the message says what to do."""


def _log(message: str) -> None:
    print(f"[opscommon.build] {message}", file=sys.stderr, flush=True)


def target_version_macro(version: tuple[int, int] = TORCH_TARGET_VERSION) -> str:
    """``-DTORCH_TARGET_VERSION`` value: major in bits 56-63, minor in 48-55."""
    major, minor = version
    return f"0x{(major << 56) | (minor << 48):016x}"


def parse_cuda_choice(value: str | None) -> str:
    """Normalise the ``OPS_CUDA`` value to ``auto``, ``0`` or ``1``."""
    v = (value or "auto").strip().lower()
    if v in ("auto", ""):
        return "auto"
    if v in ("1", "yes", "true", "on", "cuda"):
        return "1"
    if v in ("0", "no", "false", "off", "cpu"):
        return "0"
    raise BuildConfigError(f"{CUDA_ENV}={value!r} is not understood: use auto, 0 (CPU) or 1 (CUDA)")


def nvcc_version(nvcc: str) -> tuple[int, int]:
    """Return (major, minor) of an nvcc binary, from ``nvcc --version``."""
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise BuildConfigError(f"could not read the CUDA version from `{nvcc} --version`:\n{out}")
    return int(m.group(1)), int(m.group(2))


def find_nvcc(env: Mapping[str, str] | None = None) -> str | None:
    """nvcc under CUDA_HOME / CUDA_PATH if set, else on PATH."""
    env = os.environ if env is None else env
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = env.get(var)
        if home:
            candidate = Path(home) / "bin" / "nvcc"
            return str(candidate) if candidate.exists() else None
    return shutil.which("nvcc", path=env.get("PATH"))


@dataclass(frozen=True)
class Variant:
    """The build the helper chose, and why."""

    cuda: bool
    reason: str
    cuda_version: str | None = None  # torch.version.cuda for a CUDA build
    nvcc_version: tuple[int, int] | None = None  # (major, minor) of the nvcc a CUDA build uses


def choose_variant(
    choice: str,
    torch_cuda: str | None,
    nvcc: str | None,
    nvcc_ver: tuple[int, int] | None,
    arch_list_error: str | None = None,
) -> Variant:
    """Decide CPU or CUDA from the request and what the machine has.

    Pure function (the unit tests drive it); :func:`detect_variant` feeds it
    the real machine.
    """
    if choice == "0":
        return Variant(False, f"{CUDA_ENV}=0 asks for the CPU variant")
    problems = []
    if torch_cuda is None:
        problems.append(
            "the installed torch is a CPU-only build (torch.version.cuda is None); install a CUDA build of torch"
        )
    if nvcc is None:
        problems.append("nvcc was not found (set CUDA_HOME to a CUDA toolkit or put nvcc on PATH)")
    elif torch_cuda is not None and nvcc_ver is not None:
        torch_major = int(torch_cuda.split(".")[0])
        if nvcc_ver[0] != torch_major:
            problems.append(
                f"nvcc is CUDA {nvcc_ver[0]}.{nvcc_ver[1]} but torch was built with CUDA "
                f"{torch_cuda}; install a CUDA {torch_major}.x toolkit or a torch built for "
                f"CUDA {nvcc_ver[0]}"
            )
    if arch_list_error:
        # Wrong whatever else the machine has: never a silent CPU build.
        raise BuildConfigError(
            f"{CUDA_ENV}={choice} may build the CUDA variant, but {arch_list_error}. "
            f"Fix TORCH_CUDA_ARCH_LIST (or unset it for the default), or set {CUDA_ENV}=0 to build the "
            "CPU variant, which ignores it."
        )
    if choice == "1":
        if problems:
            raise BuildConfigError(
                f"{CUDA_ENV}=1 asks for a CUDA build, but "
                + "; and ".join(problems)
                + f". Set {CUDA_ENV}=0 to build the CPU variant instead."
            )
        return Variant(True, f"{CUDA_ENV}=1 and nvcc {nvcc_ver} matches torch CUDA {torch_cuda}", torch_cuda, nvcc_ver)
    if problems:
        return Variant(False, f"{CUDA_ENV}=auto chose CPU because " + "; and ".join(problems))
    return Variant(True, f"{CUDA_ENV}=auto found nvcc {nvcc_ver} and torch CUDA {torch_cuda}", torch_cuda, nvcc_ver)


def detect_variant(env: Mapping[str, str] | None = None) -> Variant:
    """Choose the variant for this machine, from ``OPS_CUDA`` and what is
    installed: the installed torch's CUDA, or when cross-compiling
    (:func:`cross_target`) the target platform's torch's."""
    import torch

    env = os.environ if env is None else env
    choice = parse_cuda_choice(env.get(CUDA_ENV))
    cross = cross_target(env)
    torch_cuda = cross.torch_cuda if cross is not None else torch.version.cuda
    if choice == "0":
        return choose_variant(choice, torch_cuda, None, None)
    nvcc = find_nvcc(env)
    ver = nvcc_version(nvcc) if nvcc else None
    arch_error = None
    if env.get("TORCH_CUDA_ARCH_LIST"):
        try:
            validate_arch_list(env["TORCH_CUDA_ARCH_LIST"])
        except BuildConfigError as e:
            arch_error = str(e)
    return choose_variant(choice, torch_cuda, nvcc, ver, arch_error)


def expand_arch_list(value: str) -> list[str]:
    """The entries of a ``TORCH_CUDA_ARCH_LIST`` as torch reads them: spaces
    become ';', named architectures expand, then split on ';'."""
    value = value.replace(" ", ";")
    for name, arches in _NAMED_ARCHES.items():
        value = value.replace(name, arches)
    return value.split(";")


def _torch_verdict(value: str) -> str | None:
    """What the torch being built against says of the arch list: "" (it
    accepts it), its error message, or None where it cannot be asked."""
    try:
        from torch.utils.cpp_extension import _get_cuda_arch_flags
    except ImportError:
        return None
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = value
    try:
        _get_cuda_arch_flags()
        return ""
    except ValueError as e:
        return str(e)
    except Exception:
        return None
    finally:
        if old is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = old


def validate_arch_list(value: str) -> list[str]:
    """Check a ``TORCH_CUDA_ARCH_LIST`` before torch sees it: every list the
    torch being built against accepts passes ("native", named architectures
    such as "Ampere+Tegra", ';' or ' ' separated entries with "+PTX"); any
    other raises :class:`BuildConfigError`. Returns the expanded entries
    (``["native"]`` for "native", resolved by :func:`ensure_arch_list`)."""
    if value == NATIVE:
        return [NATIVE]
    entries = expand_arch_list(value)
    bad = [e for e in entries if e not in _VALID_ARCHES]
    verdict = _torch_verdict(value) if value else None
    if verdict == "" and value:
        return entries  # torch accepts it (a newer torch may know more arches)
    if bad or verdict:
        shown = ", ".join(repr(e) if not e else e for e in bad) if bad else verdict
        raise BuildConfigError(
            f"TORCH_CUDA_ARCH_LIST={value!r} is malformed (bad entries: {shown}); use compute "
            f"capabilities separated by ';' or spaces, each optionally with '+PTX', named "
            f"architectures (Ampere, Hopper, Ampere+Tegra, ...) or 'native', e.g. "
            f"'{DEFAULT_CUDA_ARCH_LIST}'"
        )
    return entries


def resolve_native_arch_list(capabilities: Iterable[tuple[int, int]], torch_arches: Iterable[str]) -> str:
    """``TORCH_CUDA_ARCH_LIST=native`` made explicit as torch makes it: the
    compute capability of every GPU present, each capped at the newest the
    torch was built for (``torch.cuda.get_arch_list()``), PTX for the last.
    No GPU: a :class:`BuildConfigError` (torch itself fails with an
    IndexError there)."""
    caps = list(capabilities)
    if not caps:
        raise BuildConfigError(
            "TORCH_CUDA_ARCH_LIST=native asks for the architectures of the GPUs of this machine, "
            "but torch sees none (no GPU, or CUDA_VISIBLE_DEVICES hides them); name the "
            f"architectures instead, e.g. TORCH_CUDA_ARCH_LIST='{DEFAULT_CUDA_ARCH_LIST}'"
        )
    sms = [int("".join(re.findall(r"\d+", a.split("_")[1]))) for a in torch_arches if "sm_" in a]
    newest = max(((sm // 10, sm % 10) for sm in sms), default=None)
    arches = sorted({"{}.{}".format(*(min(newest, cap) if newest else cap)) for cap in caps})
    arches[-1] += "+PTX"
    return ";".join(arches)


def ensure_arch_list(env: dict | None = None) -> str:
    """Set ``TORCH_CUDA_ARCH_LIST`` to the default when unset and resolve
    ``native`` from the GPUs present; validate it."""
    env = os.environ if env is None else env
    value = env.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        env["TORCH_CUDA_ARCH_LIST"] = value = DEFAULT_CUDA_ARCH_LIST
        _log(f"TORCH_CUDA_ARCH_LIST unset, using {value}")
    elif value == NATIVE:
        import torch

        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        env["TORCH_CUDA_ARCH_LIST"] = value = resolve_native_arch_list(caps, torch.cuda.get_arch_list())
        _log(f"TORCH_CUDA_ARCH_LIST=native: the GPUs present are {value}")
    validate_arch_list(value)
    return value


CROSS_TORCH_ENV = "OPS_CROSS_TORCH"
CROSS_PLAT_ENV = "OPS_CROSS_PLAT"
# Wheel platform (``linux_<machine>``) -> what ``$CXX -dumpmachine`` starts with.
_CROSS_MACHINES = {"linux_aarch64": "aarch64", "linux_x86_64": "x86_64"}


@dataclass(frozen=True)
class CrossTarget:
    """A build for another CPU: the target torch's folder, wheel platform and compiler."""

    torch_root: Path  # the ``torch`` package folder of the target platform's wheel
    plat_name: str  # bdist_wheel platform, e.g. ``linux_aarch64``
    compiler: str  # ``$CXX``
    torch_version: str  # ``torch/version.py``'s __version__ of the target wheel
    torch_cuda: str | None = None  # its ``cuda`` ("13.0"; None for a CPU-only torch)

    @property
    def machine(self) -> str:
        return _CROSS_MACHINES[self.plat_name]

    @property
    def include_dirs(self) -> list[str]:
        inc = self.torch_root / "include"
        return [str(inc), str(inc / "torch" / "csrc" / "api" / "include")]

    @property
    def library_dirs(self) -> list[str]:
        return [str(self.torch_root / "lib")]


def _compiler_machine(compiler: str) -> str:
    """``$CXX -dumpmachine`` (``aarch64-linux-gnu``), or a BuildConfigError."""
    try:
        out = subprocess.run([*compiler.split(), "-dumpmachine"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildConfigError(f"CXX={compiler!r} does not run ({e}): install the cross compiler") from None
    return out.stdout.strip()


def cross_target(env: Mapping[str, str] | None = None) -> CrossTarget | None:
    """The cross-compilation target of ``OPS_CROSS_TORCH`` / ``OPS_CROSS_PLAT``
    (None when neither is set), checked: the target torch's headers and
    libraries are there and ``$CXX`` compiles for that CPU. A build never
    writes a binary for one CPU into a wheel tagged for another."""
    env = os.environ if env is None else env
    root, plat = env.get(CROSS_TORCH_ENV), env.get(CROSS_PLAT_ENV)
    if not root and not plat:
        return None
    if not root or not plat:
        raise BuildConfigError(f"cross-compiling needs both {CROSS_TORCH_ENV} and {CROSS_PLAT_ENV} (one is unset)")
    if plat not in _CROSS_MACHINES:
        raise BuildConfigError(f"{CROSS_PLAT_ENV}={plat!r} is not one of {', '.join(sorted(_CROSS_MACHINES))}")
    torch_root = Path(root)
    for need in ("include/torch/csrc/stable", "lib/libtorch_cpu.so", "lib/libc10.so", "version.py"):
        if not (torch_root / need).exists():
            raise BuildConfigError(
                f"{CROSS_TORCH_ENV}={root!r} has no {need}: point it at the `torch` folder of the "
                f"unpacked {plat} torch wheel"
            )
    compiler = env.get("CXX", "")
    if not compiler:
        raise BuildConfigError(
            f"cross-compiling for {plat} needs CXX set to a compiler for it (e.g. aarch64-linux-gnu-g++)"
        )
    machine = _compiler_machine(compiler)
    if not machine.startswith(_CROSS_MACHINES[plat] + "-"):
        raise BuildConfigError(f"CXX={compiler!r} compiles for {machine}, not for {plat}")
    version_py = (torch_root / "version.py").read_text()
    m = re.search(r"^__version__ = '([^']+)'", version_py, re.M)
    cuda = re.search(r"^cuda(?:: [^=]+)? = '([^']+)'", version_py, re.M)
    return CrossTarget(torch_root, plat, compiler, m.group(1) if m else "unknown", cuda.group(1) if cuda else None)


def retarget(ext, cross: CrossTarget) -> None:
    """Point an extension's torch include and library folders (those of the
    torch that runs the build) at the target platform's torch."""
    from torch.utils.cpp_extension import include_paths, library_paths

    host_inc, host_lib = set(include_paths()), set(library_paths())
    ext.include_dirs = [d for d in ext.include_dirs if d not in host_inc] + cross.include_dirs
    ext.library_dirs = cross.library_dirs + [d for d in ext.library_dirs if d not in host_lib]


def glibc_compat_dir() -> str:
    """Folder of the glibc 2.28 compatibility headers (see its files)."""
    return os.path.join(get_include(), "opscommon", "glibc_compat")


def free_threaded_python() -> bool:
    """Whether the running CPython is a free-threaded build (3.13t, 3.14t)."""
    import sysconfig

    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def nvcc_threads() -> int:
    """Architectures one nvcc compiles at once (its ``--threads``): ``MAX_JOBS``,
    else the CPU count. Without it a source's architectures compile one after
    another, and the largest source alone sets a build's time: the compile
    check of every CUDA source for five architectures took 1714 s on 2 cores
    in sequence, 1018 s two at a time."""
    try:
        jobs = int(os.environ.get("MAX_JOBS", ""))
    except ValueError:
        jobs = 0
    return jobs if jobs > 0 else (os.cpu_count() or 1)


def compile_flags(cuda: bool, free_threaded: bool | None = None) -> dict[str, list[str]]:
    """Compiler flags for the stable ABI targeting torch 2.10, glibc 2.28.

    ``Py_LIMITED_API`` only where the building CPython has a limited API
    (``free_threaded`` False; default: the running one): a free-threaded
    CPython's headers refuse it."""
    if free_threaded is None:
        free_threaded = free_threaded_python()
    compat = glibc_compat_dir()
    common = [
        "-O3",
        f"-DTORCH_TARGET_VERSION={target_version_macro()}",
        *([] if free_threaded else [f"-DPy_LIMITED_API={LIMITED_API_HEX}"]),
        # found before the system's <sys/single_threaded.h> (glibc >= 2.32)
        "-isystem",
        compat,
    ]
    force = ["-include", os.path.join(compat, "opscommon_glibc_compat.h")]
    flags = {"cxx": common + force + ["-std=c++17", "-fvisibility=hidden"]}
    if cuda:
        # USE_CUDA exposes the CUDA part of the C shim (the current stream).
        cuda_defines = ["-DOPS_WITH_CUDA", "-DUSE_CUDA"]
        flags["cxx"] += cuda_defines
        flags["nvcc"] = common + force + cuda_defines + ["-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
        flags["nvcc"] += ["--threads", str(nvcc_threads())]
    return flags


def variant_label(variant: Variant, nvcc_ver: tuple[int, int] | None) -> str:
    """Local version label of a build: "" for CPU, "cu130" for CUDA 13.0."""
    if not variant.cuda:
        return ""
    if nvcc_ver is None:
        raise BuildConfigError("a CUDA build needs the nvcc version for its version label")
    return f"cu{nvcc_ver[0]}{nvcc_ver[1]}"


def _sources(root: Path, patterns: Iterable[str]) -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        found += sorted(str(p.relative_to(root)) for p in root.glob(pattern))
    return found


def _prepare_cross_cuda(cross: CrossTarget) -> None:
    """Checks and settings of a CUDA cross build. nvcc (of the build machine)
    compiles the device code and hands the host code to $CC (torch passes
    -ccbin); CUDA_HOME's include/ and lib/ must be the target CPU's."""
    import torch.utils.cpp_extension as cpp_extension

    for need in ("lib/libtorch_cuda.so", "lib/libc10_cuda.so"):
        if not (cross.torch_root / need).exists():
            raise BuildConfigError(f"{CROSS_TORCH_ENV}={cross.torch_root} has no {need} for a CUDA build")
    if cpp_extension.CUDA_HOME is None:
        # The torch running the build is CPU-only (the target's is the CUDA
        # build): torch reads CUDA_HOME only when it was built with CUDA.
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if not home:
            raise BuildConfigError("a CUDA cross build needs CUDA_HOME (nvcc of this machine, the target's CUDA files)")
        cpp_extension.CUDA_HOME = home


def extension(package: str, root: str | os.PathLike, variant: Variant | None = None):
    """Return the stable-ABI extension ``<package>._C`` from ``root/csrc``.

    ``csrc/**/*.cpp`` always build; ``csrc/**/*.cu`` only in the CUDA variant.
    """
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    root = Path(root)
    variant = variant or detect_variant()
    _log(f"{package}: building the {'CUDA' if variant.cuda else 'CPU'} variant ({variant.reason})")
    sources = _sources(root, ["csrc/**/*.cpp"])
    kwargs = dict(
        name=f"{package}._C",
        include_dirs=[get_include(), str(root / "csrc")],
        extra_compile_args=compile_flags(variant.cuda),
        # The file name only (_C.abi3.so; a free-threaded CPython has no
        # abi3 suffix): torch loads it by path, whatever the name says.
        py_limited_api=True,
    )
    cross = cross_target()
    if cross is not None:
        _log(
            f"{package}: cross-compiling for {cross.plat_name} with {cross.compiler}, "
            f"against torch {cross.torch_version} at {cross.torch_root}"
        )
        if variant.cuda:
            _prepare_cross_cuda(cross)
    if variant.cuda:
        ensure_arch_list()
        ext = CUDAExtension(sources=sources + _sources(root, ["csrc/**/*.cu"]), **kwargs)
    else:
        ext = CppExtension(sources=sources, **kwargs)
    if cross is not None:
        retarget(ext, cross)
    return ext


def build_info(package: str, version: str, variant: Variant, label: str = "", cross: CrossTarget | None = None) -> dict:
    """What the runtime loader checks at import: torch range and CUDA major."""
    import torch

    built_with = cross.torch_version if cross is not None else torch.__version__
    return {
        "package": package,
        "version": version + (f"+{label}" if label else ""),
        "variant": label or "cpu",
        "torch_built_with": built_with.split("+")[0],
        "torch_min": ".".join(map(str, TORCH_TARGET_VERSION)),
        "cuda": variant.cuda_version if variant.cuda else None,
        # The toolkit that compiled it (the version label's cu124), which may
        # be an older minor than torch's own CUDA (12.8).
        "cuda_toolkit": "{}.{}".format(*variant.nvcc_version) if variant.cuda and variant.nvcc_version else None,
        "cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST") if variant.cuda else None,
    }


def runtime_module_source(info: dict) -> str:
    """The ``<package>/_runtime.py`` written into every built package."""
    template = (Path(__file__).parent / "runtime_template.py").read_text()
    placeholder = "BUILD_INFO: dict = {}  # filled in at build time\n"
    assert placeholder in template, "runtime_template.py lost its BUILD_INFO line"
    header = "# Generated from opscommon/runtime_template.py at build time; do not edit.\n"
    return header + template.replace(placeholder, f"BUILD_INFO: dict = {info!r}\n")


# What an op's sdist carries of opscommon (the build helper and headers; not
# the test contract or benchmark helpers), in ``VENDOR_DIR/opscommon``.
VENDOR_DIR = "_opscommon"
_VENDORED = ("__init__.py", "build.py", "runtime_template.py", "include")


def vendor_into(dest: str | os.PathLike) -> Path:
    """Copy the build helper and headers into ``dest/_opscommon/opscommon``."""
    src = Path(__file__).parent
    target = Path(dest) / VENDOR_DIR / "opscommon"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in _VENDORED:
        if (src / name).is_dir():
            shutil.copytree(src / name, target / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src / name, target / name)
    return target


def _bdist_wheel_command():
    from setuptools.command.bdist_wheel import bdist_wheel

    class AnyPythonWheel(bdist_wheel):
        """bdist_wheel that tags the wheel ``py3-none-<platform>``: its
        library uses no Python C API (see the module docstring)."""

        def get_tag(self) -> tuple[str, str, str]:
            plat = super().get_tag()[2]
            return WHEEL_PYTHON_TAG, WHEEL_ABI_TAG, plat

    return AnyPythonWheel


def _sdist_command():
    from setuptools.command.sdist import sdist

    class VendoringSdist(sdist):
        """sdist that carries opscommon's build helper and headers, so the
        sdist builds in isolation from public packages only."""

        def make_release_tree(self, base_dir, files) -> None:
            super().make_release_tree(base_dir, files)
            _log(f"vendoring opscommon into {vendor_into(base_dir)}")

    return VendoringSdist


def setup_kwargs(package: str, version: str, root: str | os.PathLike) -> dict:
    """Everything an op's ``setup.py`` passes to ``setuptools.setup``.

    Builds ``<package>._C`` with ninja and writes ``<package>/_runtime.py``
    (loader, import-time version checks, argument checks for fake kernels);
    a CUDA build's version gets its label (``+cu130``); the wheel is tagged
    ``py3-none-<platform>``; the sdist carries opscommon's build helper and
    headers.
    """
    from torch.utils.cpp_extension import BuildExtension

    variant = detect_variant()
    label = variant_label(variant, variant.nvcc_version)
    cross = cross_target()
    info = build_info(package, version, variant, label, cross)

    class BuildOpExtension(BuildExtension.with_options(use_ninja=True)):
        def run(self) -> None:
            super().run()
            dest_root = Path(self.build_lib)
            if self.inplace:
                dest_root = Path(root) / "src"
            dest = dest_root / package / "_runtime.py"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(runtime_module_source(info))
            _log(f"{package}: wrote {dest}")

    options: dict = {}
    if cross is not None:  # the wheel is tagged for the CPU its binary is for
        options["bdist_wheel"] = {"plat_name": cross.plat_name}
    if label:
        # 0.1.0+cu130: the version itself says which variant a wheel is.
        options["egg_info"] = {"tag_build": f"+{label}"}
        _log(f"{package}: version {version}+{label}")
    return dict(
        ext_modules=[extension(package, root, variant)],
        cmdclass={"build_ext": BuildOpExtension, "bdist_wheel": _bdist_wheel_command(), "sdist": _sdist_command()},
        options=options,
    )
