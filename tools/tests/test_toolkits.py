"""tools.toolkits: the Debian CUDA toolkit lane, without the network (the
archive is faked by .deb files made here, or is a closed local port)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tools import matrix, toolkits
from tools.matrix import Toolkit

M = matrix.load()
DEBIAN = [tk for tk in M.toolkits.values() if tk.source == "debian"]
needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="dpkg-deb not installed")
needs_apt = pytest.mark.skipif(
    shutil.which("apt-get") is None or not Path(toolkits.DEBIAN_KEYRING).is_file(),
    reason="apt-get or the Debian keyring not installed",
)


def fake_nvcc(path: Path, release: str = "12.4") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.131'\n")
    path.chmod(0o755)
    return path


def debian_tk(**extra) -> Toolkit:
    keys = {
        "archives": ["http://127.0.0.1:9/debian"],
        "suite": "trixie",
        "components": ["main", "non-free"],
        "packages": ["fake-cuda-toolkit=12.4.131~12.4.1-2", "fake-cuda-dev=1:12.4-1"],
    }
    keys.update(extra)
    return Toolkit(version="12.4", source="debian", torch="2.10", arch_list="7.5;8.0;8.6;9.0+PTX", extra=keys)


@pytest.fixture(autouse=True)
def no_cuda_home(monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)


# -- matrix.toml -------------------------------------------------------------------------


def test_matrix_has_a_cuda12_debian_lane_with_exact_pins():
    assert any(tk.major == "12" for tk in DEBIAN), "no CUDA 12 toolkit of source debian in matrix.toml"
    for tk in DEBIAN:
        src = toolkits.debian_source(tk)
        names = [name for name, _ in src.packages]
        for needed in ("nvidia-cuda-toolkit", "nvidia-cuda-dev", "libcudart12", "libcu++-dev"):
            assert needed in names
        assert all(version and "*" not in version for _, version in src.packages)
        assert toolkits.requirements(tk) == []


def test_cuda124_arch_list_stays_within_what_it_can_target():
    tk = M.toolkits["12.4"]
    assert tk.arch_list != M.arch_list  # its own: 10.0 and 12.0 need CUDA 12.8+
    archs = [e.removesuffix("+PTX") for e in tk.arch_list.split(";")]
    assert max(tuple(map(int, a.split("."))) for a in archs) <= (9, 0)
    assert tk.arch_list.endswith("+PTX")  # newer GPUs run the PTX
    assert tk.variant == "cu124" and tk.torch in M.torches and M.torches[tk.torch].cuda_major == "12"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"archives": []}, "archives"),
        ({"suite": ""}, "suite"),
        ({"components": []}, "components"),
        ({"packages": []}, "packages"),
        ({"packages": ["nvidia-cuda-dev"]}, "name=exact-version"),
        ({"packages": ["Bad Name=1"]}, "name=exact-version"),
    ],
)
def test_debian_keys_are_checked(change, message):
    with pytest.raises(ValueError, match=message):
        toolkits.debian_source(debian_tk(**change))


def test_a_lane_with_bad_keys_is_unavailable_with_the_reason(tmp_path):
    home, reason = toolkits.locate(debian_tk(suite=""), cache=tmp_path)
    assert home is None and "needs `suite`" in reason


# -- the private apt configuration ---------------------------------------------------------


def test_apt_configuration_is_private(tmp_path):
    src = toolkits.debian_source(debian_tk())
    line = toolkits.sources_line(src, "http://deb.debian.org/debian/")
    assert line == (
        f"deb [arch=amd64 signed-by={toolkits.DEBIAN_KEYRING}] http://deb.debian.org/debian trixie main non-free\n"
    )
    opts = toolkits.apt_options(tmp_path)
    values = dict(o.split("=", 1) for o in opts[1::2])
    assert values["Dir::Etc::sourceparts"] == "-" and values["Dir::Etc::preferencesparts"] == "-"
    for key in ("Dir::Etc::sourcelist", "Dir::State::Lists", "Dir::State::status", "Dir::Cache"):
        assert values[key].startswith(str(tmp_path)), key
    assert "Acquire::Check-Valid-Until" not in values
    snap = dict(
        o.split("=", 1)
        for o in toolkits.apt_options(tmp_path, "http://snapshot.debian.org/archive/debian/20250801T000000Z")[1::2]
    )
    assert snap["Acquire::Check-Valid-Until"] == "false"


def test_deb_file_names_follow_apt_get_download(tmp_path):
    assert toolkits.deb_file_pattern("libcu++-dev", "2.3.2-2") == "libcu++-dev_2.3.2-2_*.deb"
    assert toolkits.deb_file_pattern("x", "1:2.0~rc1-1") == "x_1%3a2.0~rc1-1_*.deb"
    src = toolkits.debian_source(debian_tk())
    (tmp_path / "fake-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb").touch()
    (tmp_path / "fake-cuda-dev_1%3a12.4-0_amd64.deb").touch()  # another version: not it
    found, missing = toolkits.cached_debs(src, tmp_path)
    assert [p.name for p in found] == ["fake-cuda-toolkit_12.4.131~12.4.1-2_amd64.deb"]
    assert missing == ["fake-cuda-dev=1:12.4-1"]


@pytest.mark.parametrize(
    "member, kept",
    [
        ("./usr/include/cuda_runtime.h", True),
        ("./usr/lib/x86_64-linux-gnu/libcudart_static.a", True),
        ("./usr/lib/x86_64-linux-gnu/libcudadevrt.a", True),
        ("./usr/lib/x86_64-linux-gnu/libcublasLt_static.a", False),
        ("./usr/lib/x86_64-linux-gnu/libcufft_static_nocallback.a", False),
        ("./usr/share/doc/nvidia-cuda-dev/copyright", False),
        ("./usr/lib/nvidia-cuda-toolkit/bin/cicc", True),
    ],
)
def test_unpack_keeps_what_a_build_needs(member, kept):
    assert toolkits._keep(member) is kept


@needs_apt
def test_an_unreachable_archive_is_reported_not_raised(tmp_path):
    home, reason = toolkits.locate(debian_tk(), cache=tmp_path)  # 127.0.0.1:9: connection refused
    assert home is None
    assert "CUDA 12.4 comes from Debian's packages" in reason
    assert "http://127.0.0.1:9/debian trixie (main non-free) cannot be reached" in reason
    assert "Set CUDA_HOME" in reason
    assert not (tmp_path / "debian-cuda-12.4" / "home").exists()


def test_missing_apt_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    home, reason = toolkits.locate(debian_tk(), cache=tmp_path)
    assert home is None and "apt-get is not installed" in reason


# -- the CUDA_HOME made of the packages ------------------------------------------------------


def fake_debian_tree(root: Path) -> None:
    """What the six packages unpack to, in small."""
    tools = root / "usr/lib/nvidia-cuda-toolkit"
    fake_nvcc(tools / "bin/nvcc")
    for name in ("cicc", "g++", "gcc"):
        fake_nvcc(tools / "bin" / name)
    (tools / "bin/crt").mkdir()
    (tools / "bin/crt/link.stub").write_text("")
    (tools / "bin/nvcc.profile").symlink_to("/etc/nvcc.profile")
    (tools / "libdevice").mkdir()
    (tools / "libdevice/libdevice.10.bc").write_text("")
    (root / "usr/bin").mkdir(parents=True)
    for name in ("ptxas", "fatbinary", "nvlink", "cudafe++"):
        fake_nvcc(root / "usr/bin" / name)
    (root / "usr/bin/nvcc").write_text('#!/bin/sh\nexec /usr/lib/nvidia-cuda-toolkit/bin/nvcc "$@"\n')
    inc = root / "usr/include"
    (inc / "nv").mkdir(parents=True)
    (inc / "nv/target").write_text("")
    (inc / "crt").mkdir()
    (inc / "crt/host_config.h").write_text("#if __GNUC__ > 13\n#error -- unsupported GNU version!\n#endif\n")
    (inc / "cuda_runtime.h").write_text("")
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.12.4.127").write_text("")
    (lib / "libcudart.so.12").symlink_to("libcudart.so.12.4.127")
    (lib / "libcudart.so").symlink_to("libcudart.so.12")
    (lib / "libcublas.so").symlink_to("libcublas.so.12")  # libcublas12 is not fetched


def test_arrange_home_makes_a_relocatable_cuda_home(tmp_path):
    home = tmp_path / "home"
    fake_debian_tree(home / "debian")
    toolkits.arrange_home(home)
    assert toolkits.nvcc_release(home / "bin" / "nvcc") == "12.4"
    for path in (
        "bin/cicc",
        "bin/ptxas",
        "bin/crt/link.stub",
        "include/cuda_runtime.h",
        "include/nv/target",
        "lib64/libcudart.so",
        "lib/libcudart.so",
        "nvvm/libdevice/libdevice.10.bc",
    ):
        assert (home / path).exists(), path
    assert not (home / "bin/g++").exists()  # nvcc uses the machine's compiler (or -ccbin)
    profile = (home / "bin/nvcc.profile").read_text()
    assert '"-I$(TOP)/include"' in profile and '"-L$(TOP)/lib64"' in profile and "/usr" not in profile
    links = [p for p in home.rglob("*") if p.is_symlink()]
    assert links and all(not os.path.isabs(os.readlink(p)) for p in links)
    assert not (home / "debian/usr/lib/x86_64-linux-gnu/libcublas.so").is_symlink()
    moved = tmp_path / "moved"
    home.rename(moved)
    assert (moved / "lib64/libcudart.so").exists() and toolkits.nvcc_release(moved / "bin/nvcc") == "12.4"
    assert toolkits.max_host_gcc(moved) == 13


def test_arrange_home_says_which_piece_is_missing(tmp_path):
    home = tmp_path / "home"
    fake_debian_tree(home / "debian")
    (home / "debian/usr/include/nv/target").unlink()
    with pytest.raises(toolkits.ToolkitUnavailable, match="libcu"):
        toolkits.arrange_home(home)


def build_deb(tmp: Path, name: str, version: str, files: Path, dest: Path) -> Path:
    pkg = tmp / f"pkg-{name}"
    shutil.copytree(files, pkg, symlinks=True)
    (pkg / "DEBIAN").mkdir()
    (pkg / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: {version}\nArchitecture: amd64\n"
        f"Maintainer: test <t@example.org>\nDescription: test\n"
    )
    out = dest / f"{name}_{version.replace(':', '%3a')}_amd64.deb"
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "-b", str(pkg), str(out)], check=True, capture_output=True
    )
    return out


@needs_dpkg
def test_cached_debs_become_a_cuda_home_with_no_network(tmp_path, monkeypatch):
    tree = tmp_path / "tree"
    fake_debian_tree(tree)
    (tree / "usr/lib/x86_64-linux-gnu/libcublasLt_static.a").write_text("big")
    (tree / "usr/share/doc/x").mkdir(parents=True)
    (tree / "usr/share/doc/x/copyright").write_text("")
    inc = tmp_path / "inc"
    (inc / "usr/include/cuda").mkdir(parents=True)
    (inc / "usr/include/cuda/version").write_text("")
    tk = debian_tk()
    cache = tmp_path / "cache"
    debs = toolkits.debian_dir(tk, cache) / "debs"
    build_deb(tmp_path, "fake-cuda-toolkit", "12.4.131~12.4.1-2", tree, debs)
    build_deb(tmp_path, "fake-cuda-dev", "1:12.4-1", inc, debs)
    logs: list[str] = []
    home = toolkits.debian_home(tk, cache, logs.append)  # archive 127.0.0.1:9 is never asked
    assert home == toolkits.debian_dir(tk, cache).resolve() / "home"
    assert not any("apt-get" in line for line in logs)
    assert (home / "include/cuda/version").exists() and (home / "bin/nvcc").exists()
    assert not (home / "debian/usr/lib/x86_64-linux-gnu/libcublasLt_static.a").exists()
    assert not (home / "debian/usr/share").exists()
    manifest = json.loads((home / toolkits.MANIFEST).read_text())
    assert manifest["packages"] == ["fake-cuda-toolkit=12.4.131~12.4.1-2", "fake-cuda-dev=1:12.4-1"]
    assert toolkits.locate(tk, cache=cache) == (home, "")  # ready: reused as it is

    def fetch(src, workdir, log):
        raise toolkits.ToolkitUnavailable(f"asked for {' '.join(src.pins)}")

    monkeypatch.setattr(toolkits, "fetch_debs", fetch)
    changed = debian_tk(packages=["fake-cuda-toolkit=12.4.131~12.4.1-3"])
    got, reason = toolkits.locate(changed, cache=cache)  # another pin: not the cached home
    assert got is None and "asked for fake-cuda-toolkit=12.4.131~12.4.1-3" in reason


@needs_dpkg
def test_a_toolkit_whose_nvcc_is_another_version_is_refused(tmp_path):
    tree = tmp_path / "tree"
    fake_debian_tree(tree)
    fake_nvcc(tree / "usr/lib/nvidia-cuda-toolkit/bin/nvcc", "12.2")
    tk = debian_tk(packages=["fake-cuda-toolkit=12.4.131~12.4.1-2"])
    build_deb(tmp_path, "fake-cuda-toolkit", "12.4.131~12.4.1-2", tree, toolkits.debian_dir(tk, tmp_path) / "debs")
    home, reason = toolkits.locate(tk, cache=tmp_path)
    assert home is None and "is CUDA 12.2, not 12.4" in reason


def test_cuda_home_of_the_lane_version_wins(tmp_path, monkeypatch):
    fake_nvcc(tmp_path / "mine/bin/nvcc", "12.4")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "mine"))
    assert toolkits.locate(debian_tk(), cache=tmp_path / "cache") == (tmp_path / "mine", "")
    assert not (tmp_path / "cache").exists()  # nothing fetched
    fake_nvcc(tmp_path / "other/bin/nvcc", "12.8")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "other"))  # another version: the lane's own source
    home, reason = toolkits.locate(debian_tk(suite=""), cache=tmp_path / "cache")
    assert home is None and "suite" in reason


# -- host compiler -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "default, limit, available, expected",
    [
        (12, 13, {13: "/usr/bin/g++-13"}, None),  # the default fits
        (14, 13, {13: "/usr/bin/g++-13", 12: "/usr/bin/g++-12"}, "/usr/bin/g++-13"),
        (14, 13, {12: "/usr/bin/g++-12"}, "/usr/bin/g++-12"),
        (14, 13, {}, None),  # nothing fits: nvcc's own error says so
        (14, None, {13: "/usr/bin/g++-13"}, None),  # limit unknown
    ],
)
def test_pick_ccbin(default, limit, available, expected):
    assert toolkits.pick_ccbin(default, limit, available) == expected


def test_build_env_names_home_and_arch_list(tmp_path):
    tk = debian_tk()
    env = toolkits.build_env(tk, tmp_path, {"CC": "gcc-13"})
    assert env == {"CUDA_HOME": str(tmp_path), "TORCH_CUDA_ARCH_LIST": "7.5;8.0;8.6;9.0+PTX"}
