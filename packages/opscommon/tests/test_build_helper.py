"""The build helper's choices: CPU or CUDA, arch list, flags, messages."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from opscommon import build
from opscommon.build import BuildConfigError, choose_variant


def test_target_version_is_torch_2_10():
    assert build.target_version_macro() == "0x020a000000000000"
    flags = build.compile_flags(cuda=False, free_threaded=False)["cxx"]
    assert "-DTORCH_TARGET_VERSION=0x020a000000000000" in flags
    assert "-O3" in flags and f"-DPy_LIMITED_API={build.LIMITED_API_HEX}" in flags
    # a free-threaded CPython's headers refuse Py_LIMITED_API
    assert not any("Py_LIMITED_API" in f for f in build.compile_flags(cuda=False, free_threaded=True)["cxx"])
    assert build.compile_flags(cuda=True, free_threaded=True)["nvcc"] == [
        f for f in build.compile_flags(cuda=True, free_threaded=False)["nvcc"] if "Py_LIMITED_API" not in f
    ]


def test_cuda_flags_only_for_cuda():
    assert "nvcc" not in build.compile_flags(cuda=False)
    nvcc = build.compile_flags(cuda=True)["nvcc"]
    assert "-DUSE_CUDA" in nvcc and "-O3" in nvcc


@pytest.mark.parametrize("max_jobs, want", [("3", 3), ("1", 1), (None, None), ("0", None), ("many", None)])
def test_nvcc_compiles_max_jobs_architectures_at_once(monkeypatch, max_jobs, want):
    """MAX_JOBS, else (unset or not a positive number) the CPU count."""
    if max_jobs is None:
        monkeypatch.delenv("MAX_JOBS", raising=False)
    else:
        monkeypatch.setenv("MAX_JOBS", max_jobs)
    want = want or os.cpu_count() or 1
    nvcc = build.compile_flags(cuda=True)["nvcc"]
    assert nvcc[nvcc.index("--threads") + 1] == str(want)
    assert "--threads" not in build.compile_flags(cuda=True)["cxx"]


@pytest.mark.parametrize(
    "value, want", [(None, "auto"), ("AUTO", "auto"), ("1", "1"), ("cuda", "1"), ("0", "0"), ("off", "0")]
)
def test_parse_cuda_choice(value, want):
    assert build.parse_cuda_choice(value) == want


def test_parse_cuda_choice_rejects_nonsense():
    with pytest.raises(BuildConfigError, match="OPS_CUDA='maybe' is not understood"):
        build.parse_cuda_choice("maybe")


def test_cpu_when_asked():
    v = choose_variant("0", "13.0", "/x/nvcc", (13, 0))
    assert not v.cuda and "OPS_CUDA=0" in v.reason


def test_auto_picks_cuda_when_everything_matches():
    v = choose_variant("auto", "13.0", "/x/nvcc", (13, 0))
    assert v.cuda and v.cuda_version == "13.0"
    # the nvcc version read once here names the build: 0.1.0+cu130
    assert v.nvcc_version == (13, 0) and build.variant_label(v, v.nvcc_version) == "cu130"
    v = choose_variant("1", "12.8", "/x/nvcc", (12, 4))
    assert v.nvcc_version == (12, 4) and build.variant_label(v, v.nvcc_version) == "cu124"


@pytest.mark.parametrize(
    "torch_cuda, nvcc, ver, reason",
    [
        (None, "/x/nvcc", (13, 0), "CPU-only build"),
        ("13.0", None, None, "nvcc was not found"),
        ("12.8", "/x/nvcc", (13, 0), "nvcc is CUDA 13.0 but torch was built with CUDA 12.8"),
    ],
)
def test_auto_falls_back_to_cpu_and_says_why(torch_cuda, nvcc, ver, reason):
    v = choose_variant("auto", torch_cuda, nvcc, ver)
    assert not v.cuda and reason in v.reason


@pytest.mark.parametrize(
    "torch_cuda, nvcc, ver, reason",
    [
        (None, "/x/nvcc", (13, 0), "CPU-only build"),
        ("13.0", None, None, "nvcc was not found"),
        ("12.8", "/x/nvcc", (13, 0), "nvcc is CUDA 13.0 but torch was built with CUDA 12.8"),
    ],
)
def test_cuda_requested_fails_loudly(torch_cuda, nvcc, ver, reason):
    with pytest.raises(BuildConfigError, match=reason) as info:
        choose_variant("1", torch_cuda, nvcc, ver)
    assert "OPS_CUDA=0" in str(info.value)  # says what to do instead


def _fake_nvcc(tmp_path, release: str) -> str:
    """A real executable that prints what nvcc --version prints."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    nvcc = bindir / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.88'\n"
    )
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return str(nvcc)


def test_nvcc_version_and_cuda_home(tmp_path):
    nvcc = _fake_nvcc(tmp_path, "12.9")
    assert build.nvcc_version(nvcc) == (12, 9)
    assert build.find_nvcc({"CUDA_HOME": str(tmp_path)}) == nvcc
    assert build.find_nvcc({"CUDA_HOME": str(tmp_path / "missing")}) is None


def test_detect_variant_on_this_machine(tmp_path):
    # The real torch and a real (fake-versioned) nvcc: a mismatch must be loud.
    env = {"OPS_CUDA": "1", "CUDA_HOME": str(tmp_path), "PATH": os.environ.get("PATH", "")}
    _fake_nvcc(tmp_path, "11.8")
    with pytest.raises(BuildConfigError):
        build.detect_variant(env)
    assert not build.detect_variant({**env, "OPS_CUDA": "0"}).cuda
    if torch.version.cuda is None:
        assert not build.detect_variant({**env, "OPS_CUDA": "auto"}).cuda


def test_arch_list_default_and_validation():
    env: dict = {}
    assert build.ensure_arch_list(env) == build.DEFAULT_CUDA_ARCH_LIST
    assert env["TORCH_CUDA_ARCH_LIST"] == build.DEFAULT_CUDA_ARCH_LIST
    for entry in ("8.0", "9.0", "PTX"):
        assert entry in build.DEFAULT_CUDA_ARCH_LIST
    assert build.validate_arch_list("8.0 9.0a;10.0+PTX") == ["8.0", "9.0a", "10.0+PTX"]
    for bad in ("", "sm_90", "9", "9.0;banana"):
        with pytest.raises(BuildConfigError, match="TORCH_CUDA_ARCH_LIST=.* is malformed"):
            build.validate_arch_list(bad)


# Lists torch's TORCH_CUDA_ARCH_LIST grammar accepts (torch.utils.cpp_extension):
# named architectures (combined names too), spaces or ';', "+PTX", "a" arches.
GOOD_ARCH_LISTS = [
    "8.0",
    "7.5;8.0;9.0;10.0;12.0+PTX",
    "8.0 9.0a;10.0+PTX",
    "Ampere+Tegra",
    "Ampere",
    "Hopper;Blackwell",
    "Turing Ampere+Tegra;9.0",
    "Kepler+Tesla;Maxwell+Tegra;Volta+Tegra;Blackwell+Tegra",
    "Ada;12.1a+PTX",
]
# ... and lists it refuses (empty entries, unknown arches, sm_ names).
BAD_ARCH_LISTS = ["", "sm_90", "9", "9.0;banana", "8.0;", "8.0  9.0", "Ampere+PTX", "8.1", "native;8.0", "8.0\t9.0"]


@pytest.mark.parametrize("value", GOOD_ARCH_LISTS)
def test_every_arch_list_torch_accepts_is_accepted(value):
    entries = build.validate_arch_list(value)
    assert entries == build.expand_arch_list(value) and all(entries)
    # the torch installed here agrees (it compiles what the helper passes)
    assert build._torch_verdict(value) in ("", None)


@pytest.mark.parametrize("value", BAD_ARCH_LISTS)
def test_arch_lists_torch_refuses_are_errors(value):
    with pytest.raises(BuildConfigError, match=r"TORCH_CUDA_ARCH_LIST=.* is malformed \(bad entries: "):
        build.validate_arch_list(value)
    if value:
        assert build._torch_verdict(value) != ""


@pytest.mark.parametrize("value", GOOD_ARCH_LISTS + BAD_ARCH_LISTS)
def test_arch_list_tables_match_torch(value, monkeypatch):
    """The helper's own tables (used where torch cannot be asked) give
    torch's verdict."""
    verdict = build._torch_verdict(value)
    if verdict is None or not value:
        pytest.skip("torch cannot be asked here")
    monkeypatch.setattr(build, "_torch_verdict", lambda v: None)
    try:
        build.validate_arch_list(value)
        ours = ""
    except BuildConfigError as e:
        ours = str(e)
    assert (ours == "") == (verdict == ""), (ours, verdict)


def test_native_arch_list_is_resolved_from_the_gpus():
    assert build.validate_arch_list("native") == ["native"]
    torch_arches = ["sm_75", "sm_80", "sm_86", "sm_90", "compute_90"]
    assert build.resolve_native_arch_list([(9, 0), (8, 6), (9, 0)], torch_arches) == "8.6;9.0+PTX"
    # a GPU newer than the torch knows: capped, as torch caps it
    assert build.resolve_native_arch_list([(12, 0)], torch_arches) == "9.0+PTX"
    with pytest.raises(BuildConfigError, match="TORCH_CUDA_ARCH_LIST=native .* torch sees none"):
        build.resolve_native_arch_list([], torch_arches)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a visible GPU")
def test_native_without_a_gpu_is_a_clear_error():
    env = {"TORCH_CUDA_ARCH_LIST": "native"}
    with pytest.raises(BuildConfigError, match="TORCH_CUDA_ARCH_LIST=native .* name the architectures instead"):
        build.ensure_arch_list(env)


@pytest.mark.parametrize("choice", ["auto", "1"])
def test_a_wrong_arch_list_is_an_error_never_a_cpu_build(choice):
    with pytest.raises(BuildConfigError, match=rf"OPS_CUDA={choice} .*'Ampere\+PTX' is malformed.*OPS_CUDA=0"):
        build.detect_variant({"OPS_CUDA": choice, "TORCH_CUDA_ARCH_LIST": "Ampere+PTX", "PATH": os.environ["PATH"]})
    # OPS_CUDA=0 ignores the arch list
    assert not build.detect_variant({"OPS_CUDA": "0", "TORCH_CUDA_ARCH_LIST": "Ampere+PTX"}).cuda


def test_runtime_module_fills_build_info():
    info = {
        "package": "x_op",
        "version": "1.2.3",
        "torch_built_with": "2.13.0",
        "torch_min": "2.10",
        "cuda": None,
        "cuda_arch_list": None,
    }
    source = build.runtime_module_source(info)
    namespace: dict = {}
    exec(compile(source, "_runtime.py", "exec"), namespace)
    assert namespace["BUILD_INFO"] == info
    namespace["check_torch"](info)  # the running torch is new enough


@pytest.mark.parametrize(
    "info_update, message",
    [
        ({"torch_min": "9.0"}, "for torch >= 9.0.*Install torch>=9.0"),
        ({"cuda": "99.0"}, "CUDA 99.0 build"),
        # the cu124 wheel: compiled with the 12.4 toolkit against torch's CUDA 12.8
        (
            {"cuda": "99.8", "cuda_toolkit": "99.4"},
            r"is a CUDA 99.4 build \(compiled with the CUDA 99.4 toolkit against a torch built for CUDA 99.8\)",
        ),
    ],
)
def test_runtime_import_checks(info_update, message):
    info = {
        "package": "x_op",
        "version": "1.2.3",
        "torch_built_with": "2.13.0",
        "torch_min": "2.10",
        "cuda": None,
        "cuda_arch_list": None,
        **info_update,
    }
    namespace: dict = {}
    exec(compile(build.runtime_module_source(info), "_runtime.py", "exec"), namespace)
    with pytest.raises(ImportError, match=message):
        namespace["check_torch"](info)


def test_cxx_flags_keep_glibc_2_28():
    flags = build.compile_flags(cuda=True)
    compat = build.glibc_compat_dir()
    assert os.path.isfile(os.path.join(compat, "sys", "single_threaded.h"))
    assert flags["cxx"][flags["cxx"].index("-isystem") + 1] == compat
    assert os.path.join(compat, "opscommon_glibc_compat.h") in flags["cxx"]
    assert flags["nvcc"][flags["nvcc"].index("-isystem") + 1] == compat
    assert os.path.join(compat, "opscommon_glibc_compat.h") in flags["nvcc"]


def test_variant_label_names_the_toolkit():
    assert build.variant_label(build.Variant(False, "cpu"), None) == ""
    assert build.variant_label(build.Variant(True, "cuda", "13.0"), (13, 0)) == "cu130"
    assert build.variant_label(build.Variant(True, "cuda", "12.8"), (12, 4)) == "cu124"
    with pytest.raises(BuildConfigError):
        build.variant_label(build.Variant(True, "cuda", "13.0"), None)


def test_build_info_carries_the_variant():
    info = build.build_info("x_op", "1.2.3", build.Variant(True, "cuda", "13.0", (13, 0)), "cu130")
    assert info["version"] == "1.2.3+cu130" and info["variant"] == "cu130" and info["cuda"] == "13.0"
    assert info["cuda_toolkit"] == "13.0"
    info = build.build_info("x_op", "1.2.3", build.Variant(True, "cuda", "12.8", (12, 4)), "cu124")
    assert info["variant"] == "cu124" and info["cuda"] == "12.8" and info["cuda_toolkit"] == "12.4"
    info = build.build_info("x_op", "1.2.3", build.Variant(False, "cpu"))
    assert info["version"] == "1.2.3" and info["variant"] == "cpu" and info["cuda"] is None


def test_vendor_into_copies_helper_and_headers(tmp_path):
    target = build.vendor_into(tmp_path)
    assert target == tmp_path / build.VENDOR_DIR / "opscommon"
    for rel in (
        "__init__.py",
        "build.py",
        "runtime_template.py",
        "include/opscommon/checks.h",
        "include/opscommon/glibc_compat/sys/single_threaded.h",
    ):
        assert (target / rel).is_file(), rel
    assert not (target / "testing.py").exists()  # the test contract is not a build input


def test_default_arch_list_runs_on_t4_to_blackwell():
    entries = build.validate_arch_list(build.DEFAULT_CUDA_ARCH_LIST)
    assert entries[0] == "7.5" and "12.0+PTX" in entries


def _fake_target_torch(root, version="2.13.0", cuda=None):
    for sub in ("include/torch/csrc/stable", "lib"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for lib in ("libtorch_cpu.so", "libc10.so"):
        (root / "lib" / lib).write_bytes(b"")
    # as torch writes it: `cuda: Optional[str] = '13.0'`
    (root / "version.py").write_text(f"__version__ = '{version}'\ncuda: Optional[str] = {cuda!r}\n")
    return root


def test_no_cross_target_by_default():
    assert build.cross_target({}) is None


@pytest.mark.parametrize(
    "env, message",
    [
        ({"OPS_CROSS_PLAT": "linux_aarch64"}, "needs both"),
        ({"OPS_CROSS_TORCH": "{root}", "OPS_CROSS_PLAT": "linux_riscv"}, "is not one of"),
        ({"OPS_CROSS_TORCH": "{root}/nothing", "OPS_CROSS_PLAT": "linux_aarch64"}, "has no include"),
        ({"OPS_CROSS_TORCH": "{root}", "OPS_CROSS_PLAT": "linux_aarch64"}, "needs CXX set"),
        ({"OPS_CROSS_TORCH": "{root}", "OPS_CROSS_PLAT": "linux_aarch64", "CXX": "no-such-g++"}, "does not run"),
    ],
)
def test_cross_target_refuses_what_cannot_build(tmp_path, env, message):
    root = _fake_target_torch(tmp_path / "torch")
    env = {k: v.format(root=root) for k, v in env.items()}
    with pytest.raises(BuildConfigError, match=message):
        build.cross_target(env)


def test_cross_target_refuses_a_compiler_for_another_cpu(tmp_path):
    # the machine's own compiler cannot make an aarch64 wheel (or, on aarch64, an x86_64 one)
    import platform
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    other = "linux_aarch64" if platform.machine() != "aarch64" else "linux_x86_64"
    root = _fake_target_torch(tmp_path / "torch")
    with pytest.raises(BuildConfigError, match=f"not for {other}"):
        build.cross_target({"OPS_CROSS_TORCH": str(root), "OPS_CROSS_PLAT": other, "CXX": "g++"})


def test_cross_target_retargets_torch_paths(tmp_path):
    import shutil

    if shutil.which("aarch64-linux-gnu-g++") is None:
        pytest.skip("needs aarch64-linux-gnu-g++ (apt-get install g++-aarch64-linux-gnu)")
    from torch.utils.cpp_extension import CppExtension, include_paths, library_paths

    root = _fake_target_torch(tmp_path / "torch", "2.13.0+cu130")
    env = {"OPS_CROSS_TORCH": str(root), "OPS_CROSS_PLAT": "linux_aarch64", "CXX": "aarch64-linux-gnu-g++"}
    cross = build.cross_target(env)
    assert cross.machine == "aarch64" and cross.torch_version == "2.13.0+cu130"
    ext = CppExtension("x._C", ["x.cpp"], include_dirs=["mine"], py_limited_api=True)
    build.retarget(ext, cross)
    assert ext.include_dirs[0] == "mine" and str(root / "include") in ext.include_dirs
    assert not set(include_paths()) & set(ext.include_dirs)
    assert ext.library_dirs[0] == str(root / "lib") and not set(library_paths()) & set(ext.library_dirs)
    info = build.build_info("x", "0.1.0", choose_variant("0", None, None, None), cross=cross)
    assert info["torch_built_with"] == "2.13.0"


def test_cross_cuda_variant_follows_the_target_torch(tmp_path):
    """A CUDA cross build is decided by the target platform's torch (PyPI's
    aarch64 torch is a CUDA 13.0 build), not by the torch that runs the build."""
    import shutil

    if shutil.which("aarch64-linux-gnu-g++") is None:
        pytest.skip("needs aarch64-linux-gnu-g++ (apt-get install g++-aarch64-linux-gnu)")
    home = tmp_path / "cuda"
    home.mkdir()
    _fake_nvcc(home, "13.0")
    cross = {"OPS_CROSS_PLAT": "linux_aarch64", "CXX": "aarch64-linux-gnu-g++", "CUDA_HOME": str(home)}
    cuda_root = _fake_target_torch(tmp_path / "cu", "2.13.0", "13.0")
    assert build.cross_target({**cross, "OPS_CROSS_TORCH": str(cuda_root)}).torch_cuda == "13.0"
    v = build.detect_variant({**cross, "OPS_CROSS_TORCH": str(cuda_root), "OPS_CUDA": "1"})
    assert v.cuda and v.cuda_version == "13.0" and v.nvcc_version == (13, 0)
    cpu_root = _fake_target_torch(tmp_path / "cpu", "2.13.0+cpu")
    assert build.cross_target({**cross, "OPS_CROSS_TORCH": str(cpu_root)}).torch_cuda is None
    with pytest.raises(BuildConfigError, match="CPU-only build"):
        build.detect_variant({**cross, "OPS_CROSS_TORCH": str(cpu_root), "OPS_CUDA": "1"})
