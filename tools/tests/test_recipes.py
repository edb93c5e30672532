"""tools.recipes: every op recipe is the one template filled with the package's values."""

from __future__ import annotations

import re

import pytest

from tools import recipes
from tools.matrix import load
from tools.packages import PACKAGES, op_packages


def test_committed_recipes_match_the_template():
    problems = recipes.check()
    assert problems == [], "\n".join(problems) + "\nrun `python -m tools.recipes --write`"


def test_every_op_package_has_a_recipe():
    for package in op_packages():
        assert recipes.recipe_path(package).is_file(), package


@pytest.mark.parametrize("package", op_packages())
def test_recipe_values_come_from_the_package(package):
    text = recipes.render_recipe(package)
    assert not re.search(r"@[A-Z_]+@", text)
    assert f"  name: {package}\n" in text
    assert f"  import_name: {package.replace('-', '_')}\n" in text
    assert f"path: ../../packages/{package}\n" in text
    assert f"packages/{package}/pyproject.toml" in text
    assert f"pytorch >={load().torch_floor} ${{{{ torch_proc_type }}}}*" in text
    # run: the stable-ABI floor and the next major as the ceiling, nothing between
    run = text.split("  run:\n")[1].split("  ignore_run_exports:")[0]
    assert f"    - pytorch >={load().torch_floor},<{load().torch_ceiling} ${{{{ torch_proc_type }}}}*\n" in run
    assert load().torch_ceiling == "3"
    assert "  license_file: LICENSE\n" in text
    assert f"  homepage: {recipes.PROJECT_URL}\n" in text
    assert "version_independent: true" in text
    assert "    - python >=${{ python_min }}\n" in text


def test_write_recipe_writes_the_rendered_text(tmp_path, monkeypatch):
    monkeypatch.setattr(recipes, "RECIPES", tmp_path)
    package = op_packages()[0]
    path = recipes.write_recipe(package)
    assert path == tmp_path / package / "recipe.yaml"
    assert path.read_text() == recipes.render_recipe(package)


def _fake_op(root, name="newthing-op", license_file=True):
    pkg = root / name
    (pkg / "tests").mkdir(parents=True)
    (pkg / "setup.py").write_text("")
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=77", "wheel", "ninja", "torch>=2.10"]\n'
        f'[project]\nname = "{name}"\nversion = "0.2.0"\n'
        'description = "A new op: it does things, fast"\nlicense = "BSD-3-Clause"\n'
        'dependencies = ["torch>=2.10"]\n'
        '[project.optional-dependencies]\ntest = ["pytest", "numpy>=1.26", "opscommon>=0.1.0"]\n'
    )
    (pkg / "README.md").write_text(f"# {name}\n\nFirst line of the\nfirst paragraph.\n\nSecond one.\n")
    if license_file:
        (pkg / "LICENSE").write_text("BSD\n")
    return pkg


def test_a_new_op_package_gets_its_recipe_from_the_same_template(tmp_path):
    _fake_op(tmp_path)
    text = recipes.render_recipe("newthing-op", packages=tmp_path)
    assert "  name: newthing-op\n  import_name: newthing_op\n" in text
    assert '  summary: "A new op: it does things, fast"\n' in text  # quoted: it has a colon
    assert "    First line of the first paragraph.\n" in text
    assert "Second one" not in text
    assert "    - setuptools >=77\n    - wheel\n    - ninja\n" in text
    assert "        - pytest\n        - numpy >=1.26\n" in text
    # torch and opscommon come from the template, once each in host
    assert text.count("\n    - opscommon\n") == 1 and text.count("\n        - opscommon\n") == 1
    assert not re.search(r"- torch\b", text)


def test_a_new_op_without_a_license_file_is_refused(tmp_path):
    _fake_op(tmp_path, license_file=False)
    with pytest.raises(ValueError, match="LICENSE"):
        recipes.render_recipe("newthing-op", packages=tmp_path)


def test_check_reports_missing_stale_and_edited_recipes(tmp_path):
    pkgs, recs = tmp_path / "packages", tmp_path / "recipes"
    _fake_op(pkgs, "a-op")
    _fake_op(pkgs, "b-op")
    (recs / "a-op").mkdir(parents=True)
    (recs / "a-op" / "recipe.yaml").write_text(recipes.render_recipe("a-op", packages=pkgs) + "# edited\n")
    (recs / "gone-op").mkdir()
    problems = recipes.check(packages=pkgs, recipes=recs)
    assert problems == [
        "recipes/a-op/recipe.yaml differs from the template's",
        "recipes/b-op/recipe.yaml is missing",
        "recipes/gone-op/ has no package under packages/",
    ]


def test_readme_paragraph_skips_the_title_and_stops_at_a_list():
    text = "# name\n\nThe op, as\na custom op.\n- a list\n\nmore\n"
    assert recipes.readme_paragraph(text) == "The op, as a custom op."
    with pytest.raises(ValueError):
        recipes.readme_paragraph("# only a title\n")


def test_conda_spec():
    assert recipes._conda_spec("setuptools>=77") == "setuptools >=77"
    assert recipes._conda_spec("wheel") == "wheel"
    assert recipes._conda_spec("torch>=2.10") is None  # the template's pytorch lines
    assert recipes._conda_spec("opscommon>=0.1") is None
    assert recipes._conda_spec('tomli; python_version < "3.11"') is None


def test_main_check_exit_status(capsys):
    assert recipes.main(["--check"]) == 0
    assert "match" in capsys.readouterr().out


def test_op_recipes_render_one_abi3_build_per_flavour():
    """The generated recipe, rendered against matrix.toml's variants: one
    package per flavour (CPU and each CUDA toolkit), built with python_min."""
    pytest.importorskip("rattler_build")
    from tools import conda_build

    matrix = load()
    package = op_packages()[0]
    variant_file = conda_build.write_variants(
        conda_build.conda_forge_variants(matrix), PACKAGES.parent / "build" / "conda" / "test-variants.yaml"
    )
    try:
        rendered = conda_build.render(package, variant_file)
    finally:
        variant_file.unlink()
    flavours = sorted(v.variant["cuda_compiler_version"] for v in rendered.kept)
    assert flavours == sorted(["None", *matrix.toolkits])
    assert {v.variant["python"] for v in rendered.kept} == {f"{matrix.abi3_min}.* *_cpython"}
    assert len(rendered.skipped) == len(flavours) * (len(matrix.pythons) - 1)


def test_op_recipes_render_for_linux_aarch64():
    """The same recipe for linux-aarch64: the CPU package and the CUDA ones
    of the variants matrix.toml builds aarch64 wheels of."""
    pytest.importorskip("rattler_build")
    from tools import conda_build

    matrix = load()
    variant_file = conda_build.write_variants(
        conda_build.conda_forge_variants(matrix, "linux-aarch64"),
        PACKAGES.parent / "build" / "conda" / "test-variants-aarch64.yaml",
    )
    try:
        rendered = conda_build.render(op_packages()[0], variant_file, "linux-aarch64")
    finally:
        variant_file.unlink()
    built = matrix.platforms["aarch64"].variants
    want = ["None", *(tk.version for tk in matrix.toolkits.values() if tk.variant in built)]
    assert sorted(v.variant["cuda_compiler_version"] for v in rendered.kept) == sorted(want)
    assert {v.variant["target_platform"] for v in rendered.kept} == {"linux-aarch64"}
