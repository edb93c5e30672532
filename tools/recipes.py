"""The op packages' conda recipes, generated from one template.

``recipes/<op>/recipe.yaml`` of every op package (``tools.packages.op_packages()``)
is ``recipes/op-recipe.yaml.in`` with the package's own values filled in:

- name and import name (``lltm-op``, ``lltm_op``);
- ``summary``: the ``description`` of its pyproject.toml; ``description``: the
  first paragraph of its README.md, then one line from matrix.toml's floors;
- license: pyproject's ``license`` (the file is the package's own LICENSE);
- host build tools: pyproject's ``[build-system] requires`` (torch and
  opscommon are in the template); test requirements: its ``test`` extra;
- the torch floor: matrix.toml's ``stable_abi.target``.

``opscommon``'s recipe (noarch, not an op) is written by hand.

Usage (from the repository root)::

    python -m tools.recipes --write   # regenerate recipes/<op>/recipe.yaml for every op
    python -m tools.recipes --check   # exit 1 when a committed recipe differs from the template's
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

from packaging.requirements import Requirement

from . import ROOT
from .matrix import load as load_matrix
from .packages import PACKAGES, import_name, op_packages

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib  # type: ignore[no-redef]

RECIPES = ROOT / "recipes"
TEMPLATE = RECIPES / "op-recipe.yaml.in"
# The project has no public page yet. rattler-build does not require these
# fields, but conda-forge's linter requires `homepage`; this is the
# one name the project's metadata uses everywhere.
PROJECT_URL = "https://github.com/pytorch-custom-ops/custom-ops"

# PyPI names whose conda-forge name differs.
_CONDA_NAMES = {"torch": "pytorch"}
# Listed by the template itself.
_IN_TEMPLATE = {"pytorch", "opscommon", "python", "pip"}


def recipe_path(package: str) -> Path:
    return RECIPES / package / "recipe.yaml"


def _pyproject(package: str, packages: Path) -> dict:
    return tomllib.loads((packages / package / "pyproject.toml").read_text())


def _conda_spec(requirement: str) -> str | None:
    """``setuptools>=77`` -> ``setuptools >=77``; None for what the template lists."""
    req = Requirement(requirement)
    name = _CONDA_NAMES.get(req.name.lower(), req.name.lower())
    if name in _IN_TEMPLATE or req.marker is not None:
        return None
    spec = str(req.specifier)
    return f"{name} {spec}" if spec else name


def readme_paragraph(readme: str) -> str:
    """The first paragraph of prose of a README (after the title), one line."""
    lines: list[str] = []
    for line in readme.splitlines():
        text = line.strip()
        if not lines and (not text or text.startswith("#")):
            continue
        if not text or text.startswith(("```", "#", "|", "- ", "* ")):
            break
        lines.append(text)
    if not lines:
        raise ValueError("README.md has no paragraph after its title")
    return " ".join(lines)


def _yaml_list(specs: list[str], indent: int) -> str:
    return "\n".join(" " * indent + f"- {s}" for s in specs)


def op_values(package: str, packages: Path = PACKAGES) -> dict[str, str]:
    """The template's placeholders for one op package, read from the package."""
    meta = _pyproject(package, packages)
    project = meta["project"]
    matrix = load_matrix()
    summary = project["description"].strip()
    paragraph = readme_paragraph((packages / package / "README.md").read_text())
    floors = (
        f"Registered with the PyTorch dispatcher (CPU and CUDA kernels, fake kernels, "
        f"autograd). One stable-ABI binary serves torch >= {matrix.torch_floor} on "
        f"CPython >= {matrix.abi3_min}."
    )
    description = "\n\n".join(
        textwrap.fill(p, 76, initial_indent="    ", subsequent_indent="    ") for p in (paragraph, floors)
    )
    host = [s for r in meta.get("build-system", {}).get("requires", []) if (s := _conda_spec(r))]
    tests = [s for r in project.get("optional-dependencies", {}).get("test", []) if (s := _conda_spec(r))]
    license_ = project.get("license")
    if not isinstance(license_, str):
        raise ValueError(f"packages/{package}/pyproject.toml: `license` must be an SPDX expression")
    if not (packages / package / "LICENSE").is_file():
        raise ValueError(f"packages/{package}/LICENSE is missing (the recipe's license_file)")
    return {
        "NAME": project["name"],
        "IMPORT_NAME": import_name(package),
        "SUMMARY": json.dumps(summary),  # a YAML double-quoted scalar
        "SUMMARY_COMMENT": summary,
        "DESCRIPTION": description,
        "LICENSE": license_,
        "HOMEPAGE": PROJECT_URL,
        "REPOSITORY": PROJECT_URL,
        "TORCH_FLOOR": matrix.torch_floor,
        "TORCH_CEILING": matrix.torch_ceiling,
        "HOST_TOOLS": _yaml_list(host, 4),
        "TEST_REQUIREMENTS": _yaml_list(tests, 8),
    }


def render_recipe(package: str, packages: Path = PACKAGES, template: Path = TEMPLATE) -> str:
    """The recipe.yaml text of one op package."""
    if package != import_name(package).replace("_", "-"):
        raise ValueError(f"{package!r}: op package folders are lowercase names with '-'")
    text = template.read_text()
    values = op_values(package, packages)
    if values["NAME"] != package:
        raise ValueError(f"packages/{package}/pyproject.toml names the project {values['NAME']!r}")
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    left = sorted(set(re.findall(r"@[A-Z_]+@", text)))
    if left:
        raise ValueError(f"{template.name}: no value for {', '.join(left)}")
    return text


def write_recipe(package: str) -> Path:
    """Write ``recipes/<package>/recipe.yaml`` from the template; return its path.

    What a new op package gets its recipe from (``nox -s new_op -- NAME``)."""
    path = recipe_path(package)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_recipe(package))
    return path


def check(packages: Path = PACKAGES, recipes: Path = RECIPES) -> list[str]:
    """Problems: op recipes that differ from the template's, op packages with no
    recipe, recipe folders with no package. Empty when all is in order."""
    problems = []
    ops = op_packages(packages)
    for package in ops:
        path = recipes / package / "recipe.yaml"
        if not path.is_file():
            problems.append(f"recipes/{package}/recipe.yaml is missing")
        elif path.read_text() != render_recipe(package, packages):
            problems.append(f"recipes/{package}/recipe.yaml differs from the template's")
    for folder in sorted(p for p in recipes.iterdir() if p.is_dir()):
        if folder.name not in ops and not (packages / folder.name).is_dir():
            problems.append(f"recipes/{folder.name}/ has no package under packages/")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.recipes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="regenerate every op package's recipe")
    mode.add_argument("--check", action="store_true", help="fail when a recipe differs from the template's")
    args = ap.parse_args(argv)
    if args.write:
        for package in op_packages():
            print(f"wrote {write_recipe(package).relative_to(ROOT)}")
        return 0
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print("run `python -m tools.recipes --write`", file=sys.stderr)
        return 1
    print(f"{len(op_packages())} op recipes match {TEMPLATE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
