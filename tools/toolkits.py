"""CUDA toolkits of matrix.toml's lanes: where each one's CUDA_HOME is.

Sources (``[[cuda.toolkit]] source``):

- ``pypi``: the exact ``requirements`` install into the session's environment
  (``requirements(tk)``); the toolkit lies at ``home`` under site-packages;
- ``system``: a toolkit of exactly that version already on the machine.

A toolkit named by ``CUDA_HOME`` wins over every source when its nvcc has the
lane's version.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from .matrix import Toolkit


class ToolkitUnavailable(RuntimeError):
    """The lane's toolkit cannot be had here; the message says why and what to do."""


def nvcc_release(nvcc: Path) -> str | None:
    """"13.0" from ``nvcc --version``, or None when it does not run."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def requirements(tk: Toolkit) -> list[str]:
    """What to install into a session's environment for this toolkit."""
    return list(tk.requirements) if tk.source == "pypi" else []


def from_cuda_home(version: str) -> Path | None:
    """CUDA_HOME, when it is set and holds an nvcc of ``version``."""
    home = os.environ.get("CUDA_HOME")
    if home and nvcc_release(Path(home) / "bin" / "nvcc") == version:
        return Path(home)
    return None


def find_system_toolkit(version: str) -> tuple[Path | None, str]:
    """A toolkit of exactly ``version`` on the machine: CUDA_HOME, CUDA_PATH,
    nvcc on PATH, /usr/local/cuda-<version>; (None, why) when there is none."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append(f"/usr/local/cuda-{version}")
    seen = []
    for home in filter(None, candidates):
        release = nvcc_release(Path(home) / "bin" / "nvcc")
        if release == version:
            return Path(home), ""
        if release:
            seen.append(f"CUDA {release} at {home}")
    found = "; found only " + ", ".join(seen) if seen else ""
    return None, f"no CUDA {version} toolkit on this machine{found}: set CUDA_HOME to one"


def _pypi_home(tk: Toolkit, purelib: Path) -> tuple[Path | None, str]:
    home = purelib / (tk.home or "")
    if not (home / "bin" / "nvcc").exists():
        return None, f"{home}/bin/nvcc missing after installing {' '.join(tk.requirements)}"
    lib = home / "lib"
    if not (lib / "libcudart.so").exists():
        sonames = sorted(lib.glob("libcudart.so.*"), key=lambda p: len(p.name))
        if sonames:  # the PyPI runtime ships only the versioned name; the linker wants this one
            (lib / "libcudart.so").symlink_to(sonames[0].name)
    release = nvcc_release(home / "bin" / "nvcc")
    if release != tk.version:
        return None, f"{home}/bin/nvcc is CUDA {release}, not {tk.version}"
    return home, ""


def locate(tk: Toolkit, purelib: Path | None = None, cache: Path | None = None) -> tuple[Path | None, str]:
    """CUDA_HOME of the toolkit, or (None, why).

    ``purelib``: site-packages of the environment where ``requirements(tk)``
    were installed (PyPI toolkits); ``cache``: a folder where toolkits that
    are fetched are kept between runs.
    """
    home = from_cuda_home(tk.version)
    if home is not None:
        return home, ""
    if tk.source == "pypi":
        if purelib is None:
            return None, f"CUDA {tk.version} comes from PyPI: install {' '.join(tk.requirements)} first"
        return _pypi_home(tk, purelib)
    return find_system_toolkit(tk.version)
