"""matrix.toml: parsed, checked, and the names derived from it."""

from __future__ import annotations

import copy

import pytest

from tools import matrix
from tools.matrix import tomllib


def _data() -> dict:
    return tomllib.loads(matrix.MATRIX_FILE.read_text())


def test_repository_matrix_loads_once():
    m = matrix.load()
    assert m is matrix.load()
    assert m.default_python in m.pythons
    assert m.lane_torch in m.torches and m.cpu_wheel_torch in m.torches
    assert m.lane_toolkit in m.toolkits


def test_variants_are_cpu_then_one_per_toolkit():
    m = matrix.load()
    assert m.variants[0] == "cpu"
    assert len(m.variants) == len(m.toolkits) + 1 == len(set(m.variants))
    for variant in m.variants[1:]:
        tk = m.toolkit_of_variant(variant)
        assert variant == "cu" + tk.version.replace(".", "")
    assert m.toolkit_of_variant("cu999") is None


def test_toolkit_of_a_cuda_torch_prefers_the_exact_version():
    m = matrix.parse(_data())
    for release in m.torches.values():
        if release.cuda_major is None:
            continue
        found = m.toolkits_for_cuda(release.cuda)
        assert all(tk.major == release.cuda_major for tk in found)
        if release.cuda in m.toolkits:
            assert found[0].version == release.cuda


def test_toolkit_arch_list_defaults_to_the_global_one():
    data = _data()
    data["cuda"]["toolkit"][0].pop("arch_list", None)
    m = matrix.parse(data)
    assert m.toolkits[data["cuda"]["toolkit"][0]["version"]].arch_list == data["cuda"]["arch_list"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["lanes"].update(torch="9.9"), "lanes.torch"),
        (lambda d: d["lanes"].update(cuda_toolkit="1.0"), "lanes.cuda_toolkit"),
        (lambda d: d["cuda"]["toolkit"][0].update(torch="9.9"), "names torch 9.9"),
        (lambda d: d["cuda"]["toolkit"][0].update(source="ftp"), "unknown source"),
        (lambda d: d["platform"][1].update(variants=["cu999"]), "unknown variants"),
        (lambda d: d["platform"][1].update(torch="9.9"), "needs `cross_prefix` and a listed `torch`"),
        (lambda d: d["platform"][1].update(wheel_tag="manylinux_2_28_x86_64"), "for another CPU"),
        (lambda d: d["platform"][1].update(native=True), "exactly one"),
    ],
)
def test_inconsistent_matrix_is_refused(mutate, message):
    data = copy.deepcopy(_data())
    mutate(data)
    with pytest.raises(ValueError, match=message):
        matrix.parse(data)


def test_platforms_one_native_and_aarch64_cross_built():
    m = matrix.load()
    assert m.native_platform.name == "x86_64"
    assert m.native_platform.variants == tuple(m.variants)
    arm = m.platforms["aarch64"]
    assert not arm.native and arm.wheel_tag == "manylinux_2_28_aarch64" and arm.plat_name == "linux_aarch64"
    assert set(arm.variants) <= set(m.variants) and "cpu" in arm.variants
    assert arm.torch in m.torches and arm.cross_prefix == "aarch64-linux-gnu-"
    # every wheel, on every CPU, keeps to torch's own manylinux_2_28 floor
    assert all(p.wheel_tag.startswith("manylinux_2_28_") for p in m.platforms.values())
