"""matrix.toml, typed and loaded once.

Everything that names the torch floor, the Python floor, the CUDA arch list,
the torch releases or the CUDA toolkits reads it from here; copies that must
exist elsewhere (opscommon's build constants, the pyprojects, the recipes)
are held to it by ``tools/tests/test_single_source.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11 running nox
    import tomli as tomllib  # type: ignore[no-redef]

from . import ROOT

MATRIX_FILE = ROOT / "matrix.toml"


@dataclass(frozen=True)
class TorchRelease:
    """One supported torch release: ``series`` "2.13", ``version`` "2.13.0",
    ``cuda`` the CUDA version of the build the package index serves ("cpu" for none)."""

    series: str
    version: str
    cuda: str

    @property
    def cuda_major(self) -> str | None:
        return None if self.cuda == "cpu" else self.cuda.split(".")[0]


@dataclass(frozen=True)
class Toolkit:
    """One CUDA toolkit lane of matrix.toml (``[[cuda.toolkit]]``)."""

    version: str
    source: str  # "pypi", "debian" or "system"
    torch: str  # series whose headers / CUDA build the lane compiles against
    arch_list: str  # TORCH_CUDA_ARCH_LIST of this toolkit's builds
    requirements: tuple[str, ...] = ()
    home: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # source-specific keys

    @property
    def major(self) -> str:
        return self.version.split(".")[0]

    @property
    def variant(self) -> str:
        """Wheel variant name and local version label: "cu130" for 13.0."""
        return "cu" + self.version.replace(".", "")


@dataclass(frozen=True)
class Platform:
    """One CPU architecture of the wheels (``[[platform]]``)."""

    name: str  # "x86_64", "aarch64": the ELF machine and wheel suffix
    wheel_tag: str  # "manylinux_2_28_aarch64"
    native: bool  # built and run on the machine of the sessions
    glibc_base: str  # the first glibc symbol version of this CPU
    variants: tuple[str, ...]  # wheel variants built for it
    cross_prefix: str = ""  # "aarch64-linux-gnu-": the cross gcc/g++
    compiler_package: str = ""  # what installs that compiler (Debian/Ubuntu)
    torch: str | None = None  # series whose wheel for this platform gives headers and libraries
    test: Mapping[str, Any] = field(default_factory=dict)  # how its wheels run here (``[platform.test]``)

    @property
    def plat_name(self) -> str:
        """bdist_wheel's platform before auditwheel: ``linux_aarch64``."""
        return f"linux_{self.name}"


@dataclass(frozen=True)
class Matrix:
    pythons: tuple[str, ...]
    default_python: str
    matrix_pythons: tuple[str, ...]
    abi3_min: str
    torch_floor: str
    torches: Mapping[str, TorchRelease]
    arch_list: str
    toolkits: Mapping[str, Toolkit]
    lane_torch: str
    lane_toolkit: str
    cpu_wheel_torch: str
    platforms: Mapping[str, Platform] = field(default_factory=dict)
    # [python.freethreaded]: the free-threaded CPython lane (version, torch,
    # where its interpreter's source comes from); empty when not configured
    freethreaded: Mapping[str, Any] = field(default_factory=dict)

    @property
    def native_platform(self) -> Platform:
        return next(p for p in self.platforms.values() if p.native)

    @property
    def torch_ceiling(self) -> str:
        """The first torch major the op packages do not claim: the stable
        ABI keeps its C shims for at least two years, not across a major
        release (the floor's major + 1: "3")."""
        return str(int(self.torch_floor.split(".")[0]) + 1)

    @property
    def variants(self) -> list[str]:
        """Wheel variants: "cpu" and one per CUDA toolkit ("cu130", ...)."""
        return ["cpu"] + [tk.variant for tk in self.toolkits.values()]

    def toolkit_of_variant(self, variant: str) -> Toolkit | None:
        for tk in self.toolkits.values():
            if tk.variant == variant:
                return tk
        return None

    def toolkits_for_cuda(self, cuda: str) -> list[Toolkit]:
        """Toolkits whose major matches a torch built with CUDA ``cuda``,
        the exact version first."""
        major = cuda.split(".")[0]
        same = [tk for tk in self.toolkits.values() if tk.major == major]
        return sorted(same, key=lambda tk: tk.version != cuda)


def parse(data: Mapping[str, Any]) -> Matrix:
    """Build a :class:`Matrix` from matrix.toml's parsed content (checked)."""
    torches = {t["series"]: TorchRelease(t["series"], t["version"], t["cuda"]) for t in data["torch"]}
    cuda = data["cuda"]
    known = {"version", "source", "torch", "arch_list", "requirements", "home"}
    toolkits = {}
    for tk in cuda["toolkit"]:
        if tk["torch"] not in torches:
            raise ValueError(f"matrix.toml: toolkit {tk['version']} names torch {tk['torch']}, not listed")
        if tk["source"] not in ("pypi", "debian", "system"):
            raise ValueError(f"matrix.toml: toolkit {tk['version']} has unknown source {tk['source']!r}")
        toolkits[tk["version"]] = Toolkit(
            version=tk["version"],
            source=tk["source"],
            torch=tk["torch"],
            arch_list=tk.get("arch_list", cuda["arch_list"]),
            requirements=tuple(tk.get("requirements", ())),
            home=tk.get("home"),
            extra={k: v for k, v in tk.items() if k not in known},
        )
    lanes = data["lanes"]
    all_variants = ["cpu"] + [tk.variant for tk in toolkits.values()]
    platforms = {}
    for entry in data.get("platform", [{"name": "x86_64", "wheel_tag": "manylinux_2_28_x86_64", "native": True}]):
        name = entry["name"]
        native = bool(entry.get("native", False))
        variants = tuple(entry.get("variants", all_variants))
        unknown = [v for v in variants if v not in all_variants]
        if unknown:
            raise ValueError(f"matrix.toml: platform {name} names unknown variants {unknown}")
        if not native and (not entry.get("cross_prefix") or entry.get("torch") not in torches):
            raise ValueError(
                f"matrix.toml: platform {name} is not native: it needs `cross_prefix` and a listed `torch`"
            )
        if not entry["wheel_tag"].endswith("_" + name):
            raise ValueError(f"matrix.toml: platform {name}'s wheel_tag {entry['wheel_tag']!r} is for another CPU")
        platforms[name] = Platform(
            name=name,
            wheel_tag=entry["wheel_tag"],
            native=native,
            glibc_base=entry.get("glibc_base", ""),
            variants=variants,
            cross_prefix=entry.get("cross_prefix", ""),
            compiler_package=entry.get("compiler_package", ""),
            torch=entry.get("torch"),
            test=entry.get("test", {}),
        )
    if sum(p.native for p in platforms.values()) != 1:
        raise ValueError("matrix.toml: exactly one [[platform]] must be native")
    m = Matrix(
        pythons=tuple(data["python"]["versions"]),
        default_python=data["python"]["default"],
        matrix_pythons=tuple(data["python"]["matrix"]),
        abi3_min=data["python"]["abi3_min"],
        torch_floor=data["stable_abi"]["target"],
        torches=torches,
        arch_list=cuda["arch_list"],
        toolkits=toolkits,
        lane_torch=lanes["torch"],
        lane_toolkit=lanes["cuda_toolkit"],
        cpu_wheel_torch=lanes["cpu_wheel_torch"],
        platforms=platforms,
        freethreaded=data["python"].get("freethreaded", {}),
    )
    ft = m.freethreaded
    if ft and (ft.get("torch") not in torches or not ft.get("version")):
        raise ValueError("matrix.toml: python.freethreaded needs a `version` and a listed `torch` series")
    for name, series in (("torch", m.lane_torch), ("cpu_wheel_torch", m.cpu_wheel_torch)):
        if series not in torches:
            raise ValueError(f"matrix.toml: lanes.{name} = {series!r} is not a listed torch series")
    if m.lane_toolkit not in toolkits:
        raise ValueError(f"matrix.toml: lanes.cuda_toolkit = {m.lane_toolkit!r} is not a listed toolkit")
    return m


@functools.cache
def load(path: Path = MATRIX_FILE) -> Matrix:
    """matrix.toml of the repository, parsed once."""
    return parse(tomllib.loads(Path(path).read_text()))
