"""CPU tests of harness.kernels: no nvcc, no GPU, no torch needed."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness import kernels
from harness.project import HarnessError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("9.0", "90"),
        ("90", "90"),
        ("sm_90", "90"),
        ("90a", "90a"),
        ("12.0", "120"),
        ("compute_80", "80"),
        (" 8.9 ", "89"),
    ],
)
def test_normalize_arch(value: str, expected: str) -> None:
    assert kernels.normalize_arch(value) == expected


@pytest.mark.parametrize("value", ["", "hopper", "7.5", "9"])
def test_normalize_arch_refuses(value: str) -> None:
    with pytest.raises(HarnessError):
        kernels.normalize_arch(value)


def test_parse_compute_caps() -> None:
    assert kernels.parse_compute_caps("9.0\n9.0\n") == "90"
    with pytest.raises(HarnessError, match="different compute capabilities"):
        kernels.parse_compute_caps("9.0\n8.0\n")
    with pytest.raises(HarnessError, match="no GPU"):
        kernels.parse_compute_caps("\n")


def test_resolve_arch_prefers_flag_then_detection() -> None:
    assert kernels.resolve_arch("8.0", query=lambda: "9.0\n") == "80"
    assert kernels.resolve_arch(None, query=lambda: "9.0\n") == "90"
    with pytest.raises(HarnessError, match="pass --arch"):
        kernels.resolve_arch(None, query=lambda: None)


def test_generator_arch_and_gencode() -> None:
    assert kernels.generator_arch("90a") == "9.0"
    assert kernels.generator_arch("120") == "12.0"
    assert kernels.gencode("90") == ["-gencode", "arch=compute_90,code=sm_90"]


@pytest.mark.parametrize("name", ["marlin_series", "marlin_base", "m2"])
def test_namespace_ok(name: str) -> None:
    assert kernels.check_namespace(name) == name


@pytest.mark.parametrize("name", ["_moe_C", "_C", "2abc", "a-b", "", "x" * 65])
def test_namespace_refused(name: str) -> None:
    with pytest.raises(HarnessError):
        kernels.check_namespace(name)


def _toolchain(tmp_path: Path) -> kernels.Toolchain:
    return kernels.Toolchain(
        nvcc=Path("/cuda/bin/nvcc"),
        cxx=Path("/usr/bin/g++"),
        python=Path("/py"),
        torch_dir=tmp_path / "torch",
        torch_version="2.14.0",
        cuda_include=None,
        nvcc_version="13.0 V13.0.88",
    )


def test_compile_steps_namespaces_and_flags(tmp_path: Path) -> None:
    tc = _toolchain(tmp_path)
    src, obj = tmp_path / "src", tmp_path / "obj"
    units = [src / kernels.MOE_DIR / n for n in ("sm80_kernel_a.cu", "sm80_kernel_a_b64.cu")]
    steps = {
        s.name: s
        for s in kernels.compile_steps(
            tc,
            src,
            obj,
            "marlin_x",
            "90",
            units=units,
            ptxas_verbose=True,
            extra_include=tmp_path / "inc",
        )
    }
    assert set(steps) == {
        "kernels-sm80_kernel_a",
        "kernels-sm80_kernel_a_b64",
        "ops",
        "repack",
        "binding",
    }
    for name in ("kernels-sm80_kernel_a", "ops"):
        argv = steps[name].argv
        assert "-D_moe_C=marlin_x" in argv
        assert "-DMARLIN_NAMESPACE_NAME=marlin_moe_wna16_marlin_x" in argv
        assert "-static-global-template-stub=false" in argv
        assert "arch=compute_90,code=sm_90" in argv
        assert f"-I{tmp_path / 'inc'}" in argv
        assert f"-DTORCH_TARGET_VERSION={kernels.TORCH_TARGET_VERSION}" in argv
    for unit in units:
        step = steps[f"kernels-{unit.stem}"]
        assert step.argv[-6:-4] == ("-Xptxas", "-v")
        assert step.argv[-3] == str(unit)
        assert step.output == obj / f"{unit.stem}.o"
    assert "-Xptxas" not in steps["ops"].argv
    repack = steps["repack"].argv
    assert "-D_C=marlin_x" in repack
    assert not any(a.startswith("-DMARLIN_NAMESPACE_NAME") for a in repack)
    binding = steps["binding"].argv
    assert binding[0] == "/usr/bin/g++"
    assert "-DHARNESS_OPS_NAMESPACE=marlin_x" in binding
    assert str(kernels.BINDING_SOURCE) in binding


def test_kernel_units_and_counts(tmp_path: Path) -> None:
    moe = tmp_path / kernels.MOE_DIR
    moe.mkdir(parents=True)
    (moe / "sm80_kernel_b.cu").write_text("template __global__ void Marlin<1>(x);\n" * 3)
    (moe / "sm80_kernel_a_b64.cu").write_text("template __global__ void Marlin<2>(x);\n")
    (moe / "ops.cu").write_text("")
    units = kernels.kernel_units(tmp_path)
    assert [u.name for u in units] == ["sm80_kernel_a_b64.cu", "sm80_kernel_b.cu"]
    assert kernels.count_instantiations(units) == {
        "sm80_kernel_a_b64.cu": 1,
        "sm80_kernel_b.cu": 3,
    }


def test_run_parallel_limits_jobs_and_reports_failures(tmp_path: Path) -> None:
    ok = [
        kernels.Step(f"ok{i}", ("sh", "-c", f"touch {tmp_path / f'o{i}'}"), tmp_path / f"o{i}")
        for i in range(3)
    ]
    kernels.run_parallel(ok, tmp_path, jobs=1)
    assert all(s.output.exists() for s in ok)
    bad = kernels.Step("bad", ("sh", "-c", "echo broken; exit 3"), tmp_path / "never")
    with pytest.raises(HarnessError, match="compile failed: bad"):
        kernels.run_parallel([bad, *ok], tmp_path, jobs=2)


def test_link_step(tmp_path: Path) -> None:
    tc = _toolchain(tmp_path)
    step = kernels.link_step(tc, [tmp_path / "a.o"], tmp_path / "libx.so", "90")
    assert step.argv[:2] == ("/cuda/bin/nvcc", "-shared")
    assert "-ltorch_cuda" in step.argv and f"-L{tmp_path / 'torch' / 'lib'}" in step.argv


def test_binding_source_defines_the_ops() -> None:
    text = kernels.BINDING_SOURCE.read_text()
    assert "moe_wna16_marlin_gemm(Tensor! a" in text
    assert "gptq_marlin_repack(Tensor b_q_weight" in text
    assert "marlin_moe_supports_64bit_expert_offsets(int a_type_id" in text
    assert "HARNESS_OPS_NAMESPACE" in text


def test_find_toolchain_refuses_missing_nvcc(tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="nvcc not found"):
        kernels.find_toolchain(nvcc=tmp_path / "no-nvcc", probe=lambda _: {})


def test_find_toolchain_refuses_missing_headers(tmp_path: Path) -> None:
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    torch_dir = tmp_path / "torch"
    (torch_dir / "lib").mkdir(parents=True)
    probe = lambda _: {"torch_dir": str(torch_dir), "version": "2.14.0"}  # noqa: E731
    with pytest.raises(HarnessError, match="stable-ABI headers"):
        kernels.find_toolchain(nvcc=nvcc, cxx=Path("/usr/bin/g++"), probe=probe)
    header = torch_dir / "include" / "torch" / "csrc" / "stable" / "library.h"
    header.parent.mkdir(parents=True)
    header.write_text("")
    with pytest.raises(HarnessError, match="not a CUDA build"):
        kernels.find_toolchain(nvcc=nvcc, cxx=Path("/usr/bin/g++"), probe=probe)
    (torch_dir / "lib" / "libtorch_cuda.so").write_text("")
    tc = kernels.find_toolchain(nvcc=nvcc, cxx=Path("/usr/bin/g++"), probe=probe)
    assert tc.nvcc_version == "13.0 V13.0.88" and tc.torch_dir == torch_dir


def test_probe_refuses_python_without_torch(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '{}'\n")
    fake.chmod(0o755)
    with pytest.raises(HarnessError, match="no torch"):
        kernels.probe_torch(fake)


def test_library_header_shim_links_only_missing(tmp_path: Path) -> None:
    cuda, toolkit = tmp_path / "cu13", tmp_path / "toolkit"
    cuda.mkdir()
    toolkit.mkdir()
    for name in ("cublas_v2.h", "cuda_runtime.h", "crt"):
        (cuda / name).write_text("")
    (toolkit / "cuda_runtime.h").write_text("")
    (toolkit / "crt").write_text("")
    shim = kernels.library_header_shim(cuda, toolkit, tmp_path / "shim")
    assert sorted(p.name for p in shim.iterdir()) == ["cublas_v2.h"]


def test_build_refuses_bad_namespace_before_anything(tmp_path: Path) -> None:
    from harness.project import Project

    project = Project(root=tmp_path, cache=tmp_path / "c", work=tmp_path / "w")
    with pytest.raises(HarnessError, match="vLLM's own"):
        kernels.build_kernels(project, rev="series", namespace="_moe_C", arch="9.0")
    with pytest.raises(HarnessError, match="no vLLM tree"):
        kernels.build_kernels(project, rev="series", namespace="ok_ns", arch="9.0")


def _tree(tmp_path: Path, ops: str, repack: str) -> Path:
    src = tmp_path / "src"
    (src / kernels.MOE_DIR).mkdir(parents=True)
    (src / kernels.OPS_SOURCE).write_text(ops)
    (src / kernels.REPACK_SOURCE).parent.mkdir(parents=True)
    (src / kernels.REPACK_SOURCE).write_text(repack)
    return src


def test_schema_defines_follow_the_tree(tmp_path: Path) -> None:
    # vLLM 0.33.0: 8-bit activations (a_scales, is_a_8bit); 0.34.0: neither.
    old = _tree(
        tmp_path / "old",
        "  torch::stable::Tensor a_scales;\n",
        "    int64_t num_bits, bool is_a_8bit) {\n",
    )
    assert kernels.schema_defines(old) == [
        "-DHARNESS_GEMM_A_SCALES",
        "-DHARNESS_REPACK_IS_A_8BIT",
    ]
    new = _tree(tmp_path / "new", "const float* b_scales_ptr;\n", "int64_t num_bits) {\n")
    assert kernels.schema_defines(new) == []


def test_compile_steps_pass_schema_defines_to_the_binding_only(tmp_path: Path) -> None:
    tc = _toolchain(tmp_path)
    steps = {
        s.name: s
        for s in kernels.compile_steps(
            tc,
            tmp_path / "src",
            tmp_path / "obj",
            "marlin_x",
            "90",
            binding_defines=["-DHARNESS_GEMM_A_SCALES"],
        )
    }
    assert "-DHARNESS_GEMM_A_SCALES" in steps["binding"].argv
    assert "-DHARNESS_GEMM_A_SCALES" not in steps["ops"].argv


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the preprocessor")
@pytest.mark.parametrize(
    ("defines", "a_scales", "is_a_8bit"),
    [([], False, False), (["-DHARNESS_GEMM_A_SCALES", "-DHARNESS_REPACK_IS_A_8BIT"], True, True)],
)
def test_binding_schemas_per_release(
    tmp_path: Path, defines: list[str], a_scales: bool, is_a_8bit: bool
) -> None:
    # Preprocess the binding with a stand-in library.h and join the schema
    # literals: 0.34.0's schemas without the 8-bit arguments, 0.33.0's with.
    stub = tmp_path / "torch" / "csrc" / "stable"
    stub.mkdir(parents=True)
    (stub / "library.h").write_text("#define STABLE_TORCH_LIBRARY(ns, m) void f(M m)\n")
    proc = subprocess.run(
        [
            "g++",
            "-E",
            "-P",
            f"-I{tmp_path}",
            "-DHARNESS_OPS_NAMESPACE=ns",
            *defines,
            str(kernels.BINDING_SOURCE),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    schemas = re.findall(r'"((?:[^"\\]|\\.)*)"', proc.stdout)
    text = "".join(schemas)
    gemm = text[text.index("moe_wna16_marlin_gemm(") : text.index("-> Tensor") + 9]
    assert ("Tensor? a_scales," in gemm) is a_scales
    assert "Tensor! b_scales, " in gemm and "Tensor? global_scale, Tensor? b_zeros_or_none," in gemm
    repack = text[text.index("gptq_marlin_repack(") :]
    repack = repack[: repack.index("-> Tensor")]
    assert repack.endswith("int num_bits, bool is_a_8bit) " if is_a_8bit else "int num_bits) ")


def test_rev_base_builds_the_pinned_release_tag(project, monkeypatch, capsys) -> None:
    seen: list[str] = []

    def fake_build(project_, *, rev: str, **kwargs: object) -> Path:
        seen.append(rev)
        return Path("libx.so")

    monkeypatch.setattr(kernels, "build_kernels", fake_build)
    parser = argparse.ArgumentParser()
    kernels.add_arguments(parser)
    for rev, expected in (("base", project.pin.release.tag), ("series", "series")):
        kernels.command(project, parser.parse_args(["--rev", rev, "--namespace", "ns"]))
        assert seen[-1] == expected
