"""``nox -s new_op -- NAME``: a new op package, and its conda recipe.

The template is ``packages/round-op``, the simplest op: its tracked files are
copied with every name changed (``round-op`` -> ``NAME``, ``round_op`` ->
the import name and the operator namespace, ``ROUND_OP`` -> its upper case),
its changelog and README started afresh, its measured benchmark results left
behind. The copy builds and passes the shared test contract as it is, with
the round-half-up kernel as a working starting point: rename the op, replace
the kernel and the reference. The sessions discover the new folder by itself
(a folder of packages/ with a setup.py is an op package).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "tools"

from . import ROOT, recipes
from .packages import import_name

TEMPLATE = "round-op"
NAME_RE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*-op$")
SKIP = ("bench/results-",)  # measured results of the template op: not the new op's


def _template_files(root: Path) -> list[Path]:
    """Tracked files of the template package (git), else every file but build output."""
    folder = root / "packages" / TEMPLATE
    files = [p for p in folder.rglob("*") if p.is_file()]
    if (root / ".git").exists():  # else a copy, maybe inside another checkout's ignored folders
        try:
            out = subprocess.run(
                ["git", "ls-files", "-z", "."], cwd=folder, capture_output=True, text=True, check=True
            ).stdout
            files = [folder / f for f in out.split("\0") if f]
        except (OSError, subprocess.CalledProcessError):
            pass
    ignored = ("build", "__pycache__", ".egg-info", "_runtime.py", ".so", "_opscommon")
    return [
        f
        for f in files
        if f.is_file()
        and not any(i in str(f.relative_to(folder)) for i in ignored)
        and not str(f.relative_to(folder)).startswith(SKIP)
    ]


def rename(text: str, name: str) -> str:
    """The template's names in ``text`` changed to ``name``'s."""
    module = import_name(name)
    return (
        text.replace(TEMPLATE, name)
        .replace(import_name(TEMPLATE), module)
        .replace(import_name(TEMPLATE).upper(), module.upper())
    )


def _readme(name: str) -> str:
    module = import_name(name)
    return f"""# {name}

`{module}`: a PyTorch custom op on the LibTorch stable ABI, with CPU and CUDA
kernels registered with the dispatcher (`torch.ops.{module}`).

Made by `nox -s new_op -- {name}` from the round-op template: it still computes
round-half-up with a straight-through gradient. Rename the op, replace the
kernels in `csrc/`, the Python API in `src/{module}/ops.py` and the
reference in `tests/` (and the model of `tests/test_deploy_{module}.py`, the
deployment check: AOTInductor, from Python and from C++), then
`nox -s tests-3.11 -- {name}`.
"""


def new_op(name: str) -> list[Path]:
    """Create packages/NAME and recipes/NAME; return the files written."""
    if not NAME_RE.match(name):
        raise ValueError(
            f"{name!r}: an op package is named like 'my-op' (lower case, words joined by '-', ending in '-op')"
        )
    root = ROOT
    dest = root / "packages" / name
    if dest.exists():
        raise ValueError(f"packages/{name} exists already")
    src = root / "packages" / TEMPLATE
    written = []
    for path in _template_files(root):
        rel = Path(rename(str(path.relative_to(src)), name))
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.name == "README.md":
            target.write_text(_readme(name))
        elif rel.name == "CHANGELOG.md":
            target.write_text(f"# Changelog: {name}\n\n## Unreleased\n\n- Created from the round-op template.\n")
        elif path.suffix in (".png",):
            continue
        else:
            text = rename(path.read_text(), name)
            if rel.name == "pyproject.toml":
                text = re.sub(r'^version = ".*"', 'version = "0.1.0"', text, count=1, flags=re.M)
                text = re.sub(
                    r'^description = ".*"', f'description = "{name}: a PyTorch custom op"', text, count=1, flags=re.M
                )
            target.write_text(text)
        written.append(target)
    written.append(recipes.write_recipe(name))  # recipes/NAME, from the one recipe template
    return written


if __name__ == "__main__":
    for p in new_op(sys.argv[1]):
        print(p.relative_to(ROOT))
