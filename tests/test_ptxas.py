"""harness.ptxas: the ptxas-report parser, blocks per SM, stock/fixed comparison.

The last test compares real builds: the stock (the selected release's tag,
``v0.34.0`` for ``[base]``) and fixed (``series``) Marlin MoE kernels must
give every instantiation the same blocks per SM. It reads the ``-Xptxas -v``
logs of ``python -m harness kernels --ptxas-verbose`` builds when they exist
for the tree's current revisions; with ``VLLM_SERIES_PTXAS_BUILD=1`` it builds
NVFP4/bf16 subsets itself (about 5 minutes on 2 cores, too long for every
``nox``). That needs nvcc, a CUDA build
of torch and the vLLM tree; the test is skipped with the reason when one is
missing. It passed here with the opt-in build on v0.33.0 (2026-12-01, 285 s).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from harness import ptxas
from harness.project import Project, git

BF16, FE2M1F, FE4M3FN, U4B8, F16 = (
    1125899906909960,
    562949953487106,
    2814749767172868,
    1125899907892224,
    1125899906910725,
)


def mangled(
    a: int, b: int, s: int, threads: int, m: int, n: int, k: int, m8: int, group: str, b64: str
) -> str:
    args = f"ILl{a}ELl{b}ELl{a}ELl{s}ELi{threads}ELi{m}ELi{n}ELi{k}ELb{m8}ELi4ELi{group}ELb0E"
    return f"_ZN30marlin_moe_wna16_marlin_x6Marlin{args}{b64}EEvPK4int4S3_PS1_"


def entry(name: str, regs: int, spill: tuple[int, int] = (0, 0)) -> str:
    return (
        f"ptxas info    : Compiling entry function '{name}' for 'sm_90'\n"
        f"ptxas info    : Function properties for {name}\n"
        f"    0 bytes stack frame, {spill[0]} bytes spill stores, {spill[1]} bytes spill loads\n"
        f"ptxas info    : Used {regs} registers, used 1 barriers\n"
    )


STOCK = (
    entry(mangled(BF16, FE2M1F, FE4M3FN, 128, 1, 4, 8, 1, "1", ""), 124)
    + entry(mangled(F16, U4B8, F16, 256, 1, 8, 8, 1, "n1", ""), 128)
    + entry(mangled(BF16, FE2M1F, FE4M3FN, 128, 4, 4, 8, 0, "1", ""), 255, (106, 278))
)


def fixed(m8_regs: int = 124) -> str:
    return (
        entry(mangled(BF16, FE2M1F, FE4M3FN, 128, 1, 4, 8, 1, "1", "Lb0E"), m8_regs)
        + entry(mangled(BF16, FE2M1F, FE4M3FN, 128, 1, 4, 8, 1, "1", "Lb1E"), 128)
        + entry(mangled(F16, U4B8, F16, 256, 1, 8, 8, 1, "n1", "Lb0E"), 128)
        + entry(mangled(BF16, FE2M1F, FE4M3FN, 128, 4, 4, 8, 0, "1", "Lb0E"), 255, (106, 278))
    )


def test_blocks_per_sm_formula() -> None:
    assert ptxas.blocks_per_sm(127, 128, 1) == 4
    assert ptxas.blocks_per_sm(128, 128, 1) == 3
    assert ptxas.blocks_per_sm(126, 256, 1) == 2
    assert ptxas.blocks_per_sm(128, 256, 1) == 1
    assert ptxas.blocks_per_sm(100, 128, 2) == 2  # cap 2 for m_blocks > 1
    assert ptxas.blocks_per_sm(255, 256, 4) == 1


def test_parse_labels_types_groups_and_forms() -> None:
    stock = ptxas.parse_text(STOCK)
    assert sorted(stock) == [
        "bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8",
        "bf16.fe2m1f.fe4m3fn g1 t128 m4 k128 n64",
        "f16.u4b8.f16 g-1 t256 m1 k128 n128 m8",
    ]
    k = stock["f16.u4b8.f16 g-1 t256 m1 k128 n128 m8"]
    assert (k.registers, k.group_blocks, k.b_64bit_offsets, k.blocks_per_sm) == (128, -1, None, 1)
    m4 = stock["bf16.fe2m1f.fe4m3fn g1 t128 m4 k128 n64"]
    assert (m4.spill_store_bytes, m4.spill_load_bytes, m4.blocks_per_sm) == (106, 278, 2)
    fix = ptxas.parse_text(fixed())
    wide = fix["bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8 b64"]
    assert wide.b_64bit_offsets is True and wide.label_32bit in fix
    assert fix["bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8"].b_64bit_offsets is False


def test_parse_refuses_a_kernel_without_register_count() -> None:
    name = mangled(BF16, FE2M1F, FE4M3FN, 128, 1, 4, 8, 1, "1", "")
    with pytest.raises(ValueError, match="no register count"):
        ptxas.parse_text(f"ptxas info    : Compiling entry function '{name}' for 'sm_90'\n")


def test_compare_same_and_changed_blocks_per_sm() -> None:
    stock = ptxas.parse_text(STOCK)
    same = ptxas.compare(stock, ptxas.parse_text(fixed()))
    assert same.blocks_per_sm_changed() == [] and same.registers_changed() == []
    assert same.only_other == ["bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8 b64"]
    assert same.only_reference == []
    moved = ptxas.compare(stock, ptxas.parse_text(fixed(m8_regs=128)))
    assert moved.blocks_per_sm_changed() == ["bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8"]


def test_table_rows_mark_missing_kernels() -> None:
    rows = list(
        ptxas.table_rows({"stock": ptxas.parse_text(STOCK), "fixed": ptxas.parse_text(fixed())})
    )
    b64 = [r for r in rows if r[0].endswith(" b64")]
    assert b64 == [["bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8 b64", "-", "128 / 0/0 / 3"]]
    assert rows[1][:2] == ["bf16.fe2m1f.fe4m3fn g1 t128 m4 k128 n64", "255 / 106/278 / 2"]


def test_sass_functions_line_up_across_builds() -> None:
    def listing(ns: str, b64: str, body: str) -> str:
        name = mangled(BF16, FE2M1F, FE4M3FN, 128, 1, 4, 8, 1, "1", b64).replace(
            "marlin_moe_wna16_marlin_x", ns
        )
        return (
            "\nFatbin elf code:\n================\narch = sm_90\n\n\tcode for sm_90\n"
            f'\t\tFunction : {name}\n\t.headerflags\t@"EF_CUDA_SM90"\n'
            f"        /*0000*/  {body} ;  /* 0x000 */\n"
        )

    a = ptxas.sass_functions(listing("ns_stock", "", "LDC R1, c[0x0][0x28]"))
    b = ptxas.sass_functions(listing("ns_fixed", "Lb0E", "LDC R1, c[0x0][0x28]"))
    c = ptxas.sass_functions(listing("ns_fixed", "Lb0E", "LDC R2, c[0x0][0x28]"))
    assert list(a) == ["bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8"]
    assert ptxas.sass_differences(a, b) == {"bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8": True}
    assert ptxas.sass_differences(a, c) == {"bf16.fe2m1f.fe4m3fn g1 t128 m1 k128 n64 m8": False}


# ------------------------------------------------------------------ real builds


def _csrc_tree(tree: Path, rev: str) -> str | None:
    """The git tree id of ``csrc`` at ``rev``: what a kernel build compiles."""
    proc = git(tree, "rev-parse", "--verify", f"{rev}:csrc", check=False)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _current_log(tree: Path, out: Path, namespace: str, csrc: str) -> Path | None:
    """The ptxas log of an existing build of the same ``csrc``, if there is one."""
    manifest = out / f"lib{namespace}.json"
    log = out / f"build-{namespace}" / "kernels.log"
    if not manifest.exists() or not log.exists():
        return None
    info = json.loads(manifest.read_text())
    has_ptxas = any("-Xptxas" in cmd for cmd in info.get("commands", []))
    same = _csrc_tree(tree, str(info.get("commit"))) == csrc
    return log if same and has_ptxas else None


def test_stock_and_fixed_blocks_per_sm_equal(tmp_path: Path) -> None:
    from harness import kernels
    from harness.venv import venv_python

    project = Project.discover()
    tree = project.tree
    if not (tree / ".git").exists():
        pytest.skip(f"no vLLM tree at {tree} (python -m harness apply)")
    base = project.pin.release.tag  # the stock kernels: the release the tree is on
    csrc = {rev: _csrc_tree(tree, rev) for rev in (base, "series")}
    if None in csrc.values():
        pytest.skip(f"the tree lacks {base} or series: {csrc}")
    out = Path(os.environ.get("VLLM_SERIES_PTXAS_DIR", project.work / "kernels"))
    logs = {
        base: _current_log(tree, out, "marlin_base", str(csrc[base])),
        "series": _current_log(tree, out, "marlin_series", str(csrc["series"])),
    }
    if None in logs.values():
        if not os.environ.get("VLLM_SERIES_PTXAS_BUILD"):
            # Two subset builds take about 5 minutes on 2 cores: too long for every `nox`.
            pytest.skip(
                f"no ptxas logs of the current {base} and series kernels in "
                f"{out}: build them with `python -m harness kernels --ptxas-verbose`, "
                "or set VLLM_SERIES_PTXAS_BUILD=1 to let this test build NVFP4 subsets"
            )
        if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
            pytest.skip("nvcc not found: the ptxas reports need a CUDA toolkit")
        python = venv_python(project) if venv_python(project).exists() else None
        try:
            kernels.find_toolchain(python=python)
        except Exception as exc:  # no torch with headers, no compiler
            pytest.skip(f"cannot build the kernels here: {exc}")
        # Both from the same format subset, so that they line up.
        for rev, namespace in ((base, "ptx_base"), ("series", "ptx_series")):
            kernels.build_kernels(
                project,
                rev=rev,
                namespace=namespace,
                out_dir=tmp_path,
                arch="9.0",
                python=python,
                ptxas_verbose=True,
                formats=("nvfp4:bf16",),
            )
            logs[rev] = tmp_path / f"build-{namespace}" / "kernels.log"
    assert logs[base] is not None and logs["series"] is not None
    stock = ptxas.parse(logs[base])
    fix = ptxas.parse(logs["series"])
    cmp = ptxas.compare(stock, fix)
    assert not cmp.only_reference, cmp.only_reference
    assert len(cmp.common) == len(stock) > 0
    assert cmp.blocks_per_sm_changed() == []
