"""tools.conda_build and its fixture: order, variants, build.skip, the floor check."""

from __future__ import annotations

import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from tools import conda_build as cb
from tools import conda_fixture, elf
from tools.matrix import load
from tools.packages import COMMON, op_packages

# --------------------------------------------------------------------------- order


def test_build_order_is_opscommon_then_every_op_package():
    assert cb.build_order() == [COMMON, *op_packages()]


def test_build_order_of_some_packages_keeps_opscommon_first():
    last = op_packages()[-1]
    assert cb.build_order([last]) == [COMMON, last]
    with pytest.raises(SystemExit, match="no such package"):
        cb.build_order(["no-such-op"])


def test_cuda_versions_bare_means_every_toolkit_of_the_matrix():
    m = load()
    assert cb.cuda_versions(m, None) == []
    assert cb.cuda_versions(m, "") == list(m.toolkits)
    last = list(m.toolkits)[-1]
    assert cb.cuda_versions(m, f" {last} ") == [last]
    with pytest.raises(SystemExit, match="no CUDA toolkit 1.0"):
        cb.cuda_versions(m, "1.0")


def test_cli_find_links_repeat():
    args = cb.parse_args(["--find-links", "/a", "--find-links=/b", "cuda"])
    assert (args.find_links, args.cuda) == (["/a", "/b"], "")


def test_cli_options_and_nox_words_mean_the_same():
    a = cb.parse_args(["--cuda", "--render-only", "--packages=round-op,vecadd-op"])
    b = cb.parse_args(["cuda", "render", "round-op", "vecadd-op"])
    for args in (a, b):
        assert (args.cuda, args.render_only, args.packages) == ("", True, ["round-op", "vecadd-op"])
    c = cb.parse_args(["--cuda=13.0", "--variants-only"])
    assert (c.cuda, c.variants_only, c.packages) == ("13.0", True, None)


def test_requested_package():
    assert cb.requested_package([COMMON, "lltm-op", "round-op"], None) == "lltm-op"
    assert cb.requested_package([COMMON, "round-op"], None) == "round-op"
    assert cb.requested_package([COMMON], None) == COMMON
    with pytest.raises(SystemExit):
        cb.requested_package([COMMON, "round-op"], "lltm-op")


def test_every_op_package_has_a_recipe_the_build_finds():
    for package in cb.build_order():
        assert cb.recipe_file(package).is_file()


# --------------------------------------------------------------------------- variants


def _zipped_lengths_agree(variants: dict) -> None:
    for group in variants["zip_keys"]:
        assert len({len(variants[k]) for k in group}) == 1, group


def test_conda_forge_variants_come_from_matrix_toml():
    m = load()
    v = cb.conda_forge_variants(m)
    _zipped_lengths_agree(v)
    assert v["cuda_compiler_version"] == ["None", *m.toolkits]
    assert v["pytorch"] == [m.cpu_wheel_torch, *(tk.torch for tk in m.toolkits.values())]
    assert v["python"] == [f"{p}.* *_cpython" for p in m.pythons]
    assert v["python_min"] == [m.abi3_min]
    assert [p for p, is_min in zip(m.pythons, v["is_python_min"]) if is_min] == [m.abi3_min]
    assert all(v["is_abi3"])
    # one glibc floor for every flavour, the manylinux_2_28 policy the wheels keep to
    assert set(v["c_stdlib_version"]) == {cb.GLIBC_FLOOR} == {elf.MANYLINUX_2_28["GLIBC"]}


def test_linux_aarch64_variants_are_those_of_the_aarch64_wheels():
    m = load()
    v = cb.conda_forge_variants(m, "linux-aarch64")
    _zipped_lengths_agree(v)
    built = m.platforms["aarch64"].variants
    want = ["None", *(tk.version for tk in m.toolkits.values() if tk.variant in built)]
    assert v["cuda_compiler_version"] == want and "None" in want
    assert set(want) < {"None", *m.toolkits}  # cu124 (Debian's toolkit) has no aarch64 build
    assert cb.variant_file("linux-aarch64").name == "variants-linux-aarch64.yaml"
    assert "not built offline" in cb.AARCH64_NOT_BUILT


def test_bootstrap_variants_name_the_same_keys_one_value_each():
    boot = {
        "c_compiler_version": "12",
        "cxx_compiler_version": "12",
        "c_stdlib_version": "2.28",
        "pytorch": "2.13",
        "python": "3.11.* *_cpython",
        "python_min": "3.10",
    }
    v = cb.bootstrap_variants(boot, None)
    assert set(v) == set(cb.conda_forge_variants(load())) - {"zip_keys"}
    assert all(len(values) == 1 for values in v.values())
    assert cb.bootstrap_variants(boot, "13.0")["cuda_compiler_version"] == ["13.0"]


def test_write_variants_is_json(tmp_path):
    path = cb.write_variants({"python": ["3.10.* *_cpython"]}, tmp_path / "v.yaml")
    text = path.read_text()
    assert text.startswith("#")
    assert json.loads(text.split("\n", 1)[1]) == {"python": ["3.10.* *_cpython"]}


# --------------------------------------------------------------------------- build.skip

VARIANT = {"is_abi3": True, "is_python_min": False, "cuda_compiler_version": "None", "python": "3.11.* *_cpython"}


@pytest.mark.parametrize(
    "expr, expected",
    [
        ("win", False),
        ("linux", True),
        ("not (is_abi3 and is_python_min)", True),
        ("is_abi3 and not is_python_min", True),
        ('cuda_compiler_version != "None"', False),
        ('cuda_compiler_version in ("12.8", "12.9")', False),
        ("true", True),
    ],
)
def test_skip_value(expr, expected):
    assert cb.skip_value(expr, VARIANT) is expected


def test_skip_value_knows_the_platform_it_renders_for():
    assert cb.skip_value("x86_64 or linux64", VARIANT, "linux-64")
    assert not cb.skip_value("x86_64 or linux64", VARIANT, "linux-aarch64")
    assert cb.skip_value("aarch64 and linux", VARIANT, "linux-aarch64")
    assert not cb.skip_value("aarch64", VARIANT)


def test_skip_value_refuses_unknown_names_and_calls():
    with pytest.raises(ValueError, match="not a variant key"):
        cb.skip_value("is_freethreading", VARIANT)
    with pytest.raises(ValueError, match="unsupported"):
        cb.skip_value("__import__('os')", VARIANT)


def test_skipped():
    assert cb.skipped(["win", "not (is_abi3 and is_python_min)"], VARIANT)
    assert not cb.skipped(["win", "not (is_abi3 and is_python_min)"], {**VARIANT, "is_python_min": True})
    assert not cb.skipped(None, VARIANT)
    assert cb.skipped(True, VARIANT)


# --------------------------------------------------------------------------- floor check


def test_declared_floor_reads_the_run_requirements():
    floor = cb.declared_floor(
        ["python >=3.10", "__glibc >=2.28,<3.0.a0", "libstdcxx >=12", "libgcc >=12", "pytorch >=2.10 cpu*"]
    )
    assert floor == {"GLIBC": "2.28", "GLIBCXX": "3.4.30", "CXXABI": "1.3.13", "GCC": "12.0.0"}
    assert cb.declared_floor(["python"]) == {}
    # a newer GCC than the table knows is held to the newest it knows
    assert cb.declared_floor(["libstdcxx >=99"])["GLIBCXX"] == cb.LIBSTDCXX[max(cb.LIBSTDCXX)][0]


def _some_elf() -> Path:
    for cand in (sys.executable, "/bin/ls", "/usr/bin/env"):
        p = Path(cand).resolve()
        if p.is_file() and cb._is_elf(p) and elf.required_versions(p).get("GLIBC"):
            return p
    pytest.skip("no dynamically linked ELF executable found")


@pytest.fixture
def binary():
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    return _some_elf()


def test_check_binary_within_the_floor(binary):
    needs = elf.highest(binary)
    summary, problems = cb.check_binary(binary, dict(needs))
    assert problems == []
    assert f"GLIBC {needs['GLIBC']}" in summary


def test_check_binary_above_the_floor_or_undeclared(binary):
    _, problems = cb.check_binary(binary, {"GLIBC": "2.0"})
    assert any("above the declared __glibc floor" in p for p in problems)
    _, problems = cb.check_binary(binary, {})
    assert any("declares no __glibc" in p for p in problems)


# --------------------------------------------------------------------------- fixture


def test_fixture_wheel_tags():
    w = conda_fixture.WheelInfo(Path("x.whl"), "x", "1", ["py3-none-any"])
    assert w.version_independent
    assert conda_fixture.WheelInfo(Path("s.whl"), "s", "1", ["py2-none-any", "py3-none-any"]).version_independent
    assert conda_fixture.WheelInfo(Path("n.whl"), "n", "1", ["py3-none-manylinux_2_17_x86_64"]).version_independent
    assert not conda_fixture.WheelInfo(
        Path("t.whl"), "t", "1", ["cp311-cp311-manylinux_2_28_x86_64"]
    ).version_independent


def test_fixture_python_spec():
    assert conda_fixture._python_spec(">=3.9") == "python >=3.9"
    assert conda_fixture._python_spec(None) == "python"
    assert conda_fixture._python_spec("not a specifier") == "python"


def test_fixture_adds_run_exports_to_a_tar_bz2(tmp_path):
    archive = tmp_path / "p-1-0.tar.bz2"
    with tarfile.open(archive, "w:bz2") as tf:
        data = b'{"name": "p"}'
        info = tarfile.TarInfo("info/index.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    conda_fixture._add_info_file(archive, "info/run_exports.json", json.dumps({"weak": ["p >=1"]}))
    with tarfile.open(archive, "r:bz2") as tf:
        assert tf.getnames() == ["info/index.json", "info/run_exports.json"]
        assert json.loads(tf.extractfile("info/run_exports.json").read()) == {"weak": ["p >=1"]}


def test_fixture_finds_the_running_python():
    me = conda_fixture.find_python(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert me is not None and me.version.startswith(f"{sys.version_info.major}.{sys.version_info.minor}.")
    assert conda_fixture.find_python("2.1") is None
