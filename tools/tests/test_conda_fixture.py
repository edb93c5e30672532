"""tools.conda_fixture's CUDA shims: a PyPI toolkit repackaged, any other one located and shimmed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import conda_fixture
from tools.matrix import Toolkit

NVCC = '#!/bin/sh\necho "Cuda compilation tools, release {release}, V{full}"\n'


def _fake_home(root: Path, release: str = "12.4", full: str = "12.4.131") -> Path:
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(NVCC.format(release=release, full=full))
    nvcc.chmod(0o755)
    return root


@pytest.fixture
def assembled(monkeypatch):
    """What cuda_shims would package, without rattler-build: name -> (version, stage, depends, summary)."""
    got: dict[str, tuple] = {}

    def assemble(name, version, build, stage, out, depends, summary, **kw):
        got[name] = (version, stage, depends, summary)
        return out / f"{name}-{version}-{build}.conda"

    def empty(name, version, out, work, depends, summary, run_exports=None):
        got[name] = (version, None, depends, summary)
        return out / f"{name}.conda"

    monkeypatch.setattr(conda_fixture, "_assemble", assemble)
    monkeypatch.setattr(conda_fixture, "_empty_package", empty)
    return got


def test_a_non_pypi_toolkit_becomes_a_shim_to_its_cuda_home(tmp_path, monkeypatch, assembled):
    home = _fake_home(tmp_path / "cuda-12.4")
    monkeypatch.setenv("CUDA_HOME", str(home))  # tools.toolkits.locate: CUDA_HOME of the version wins
    monkeypatch.delenv("NVCC_PREPEND_FLAGS", raising=False)
    tk = Toolkit("12.4", "debian", "2.10", "9.0+PTX")
    conda_fixture.cuda_shims(tmp_path / "channel", tmp_path / "work", tk, tmp_path / "wheels")
    version, stage, depends, summary = assembled["cuda-nvcc_linux-64"]
    assert (version, depends) == ("12.4.131", ["cuda-version 12.4.*"])
    assert str(home.resolve()) in summary
    act = (stage / "etc" / "conda" / "activate.d" / "cuda-nvcc_activate.sh").read_text()
    assert f'export CUDA_HOME="{home.resolve()}"' in act
    assert 'export PATH="$CUDA_HOME/bin:$PATH"' in act
    assert not (stage / f"cuda-bootstrap-{tk.version}").exists()  # nothing of the toolkit copied
    assert assembled["cuda-version"][0] == "12.4"
    assert assembled["cuda-cudart-dev"][2] == ["cuda-version 12.4.*"]
    assert not (tmp_path / "wheels").exists()  # no wheel downloaded for it


def test_a_toolkit_that_cannot_be_had_says_why(tmp_path, monkeypatch, assembled):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    tk = Toolkit("99.9", "system", "2.10", "9.0")
    with pytest.raises(SystemExit, match="no CUDA 99.9 toolkit"):
        conda_fixture.cuda_shims(tmp_path / "channel", tmp_path / "work", tk, tmp_path / "wheels")
    assert "cuda-nvcc_linux-64" not in assembled


def test_a_shim_refuses_an_nvcc_of_another_release(tmp_path, monkeypatch, assembled):
    home = _fake_home(tmp_path / "cuda", release="12.6", full="12.6.85")
    monkeypatch.setattr(conda_fixture, "toolkit_home", lambda tk, cache=None: home)
    with pytest.raises(SystemExit, match="is not CUDA 12.4"):
        conda_fixture.cuda_shims(
            tmp_path / "channel", tmp_path / "work", Toolkit("12.4", "system", "2.10", "9.0"), tmp_path / "wheels"
        )


def test_a_pypi_toolkit_is_unpacked_into_the_package_with_find_links(tmp_path, monkeypatch, assembled):
    calls = []

    def download(requirements, dest, extra_args=()):
        calls.append((requirements, extra_args))
        return []

    def extract(whl, dest):
        raise AssertionError("no wheels")

    monkeypatch.setattr(conda_fixture, "download_wheels", download)
    tk = Toolkit("13.0", "pypi", "2.14", "9.0", requirements=("nvidia-cuda-nvcc==13.0.88",), home="nvidia/cu13")
    # the download comes back empty: no nvcc to package
    with pytest.raises(SystemExit, match="no bin/nvcc under nvidia/cu13"):
        conda_fixture.cuda_shims(
            tmp_path / "channel", tmp_path / "work", tk, tmp_path / "wheels", find_links=("/some/wheels",)
        )
    assert calls == [(["nvidia-cuda-nvcc==13.0.88"], ("--no-deps", "--find-links", "/some/wheels"))]


def test_a_shim_refuses_a_system_gxx_newer_than_the_toolkit_accepts(tmp_path, monkeypatch, assembled):
    if conda_fixture.shutil.which("g++") is None:
        pytest.skip("no g++")
    home = _fake_home(tmp_path / "cuda")
    (home / "include" / "crt").mkdir(parents=True)
    (home / "include" / "crt" / "host_config.h").write_text("#if __GNUC__ > 4\n#error unsupported\n#endif\n")
    monkeypatch.setattr(conda_fixture, "toolkit_home", lambda tk, cache=None: home)
    with pytest.raises(SystemExit, match="accepts GCC <= 4 as host compiler"):
        conda_fixture.cuda_shims(
            tmp_path / "channel", tmp_path / "work", Toolkit("12.4", "debian", "2.10", "9.0"), tmp_path / "wheels"
        )
