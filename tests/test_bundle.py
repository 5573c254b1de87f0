"""The device bundle (harness.bundle, harness.fatbin, harness.device_run), on CPU.

Everything is synthetic: a fatbin-carrying ELF file built here, a release
"wheel" zip, a tiny dependency wheel in the wheel cache, and the conftest's
materialized project. No network, no GPU; the smoke check is run only to see
that it reports failure (never a pass) where there is no GPU.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import io
import json
import platform
import signal
import struct
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from harness import bundle, device_run, e2e, fatbin, results
from harness.project import REPO, HarnessError, Project, git
from tests.conftest import IDENTITY

CommitFn = Callable[[str, dict[str, str]], str]  # the conftest's `commit` fixture

# --------------------------------------------------------------------------- synthetic fatbin


def fatbin_blob(images: Sequence[tuple[int, int, bytes]]) -> bytes:
    """One fatbin blob of ``(kind, arch, payload)`` images (48-byte image headers)."""
    body = b""
    for kind, arch, payload in images:
        header = bytearray(48)
        struct.pack_into("<HHIQ", header, 0, kind, 0x0101, 48, len(payload))
        struct.pack_into("<I", header, fatbin.IMAGE_ARCH_OFFSET, arch)
        struct.pack_into("<Q", header, fatbin.IMAGE_FLAGS_OFFSET, 0x11)
        body += bytes(header) + payload
    return struct.pack("<IHHQ", fatbin.BLOB_MAGIC, 1, 16, len(body)) + body


def elf_library(section: bytes, name: bytes = b".nv_fatbin") -> bytes:
    """A minimal little-endian ELF64 file whose only named section is ``section``."""
    names = b"\0" + name + b"\0.shstrtab\0"
    data_off = 64
    names_off = data_off + len(section)
    pad = (-(names_off + len(names))) % 8
    shoff = names_off + len(names) + pad
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    header = struct.pack("<16sHHIQQQIHHHHHH", ident, 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 3, 2)
    null = bytes(64)
    fat = struct.pack("<IIQQQQIIQQ", 1, 1, 2, 0, data_off, len(section), 0, 0, 8, 0)
    strtab = struct.pack("<IIQQQQIIQQ", 2 + len(name), 3, 0, 0, names_off, len(names), 0, 0, 1, 0)
    return header + section + names + bytes(pad) + null + fat + strtab


def payload(tag: int, size: int = 64) -> bytes:
    return bytes([tag]) * size


SM90_CUBIN, SM80_CUBIN, SM89_CUBIN, SM100_CUBIN = (
    (2, 90, payload(1)),
    (2, 80, payload(2)),
    (2, 89, payload(3)),
    (2, 100, payload(4)),
)
PTX90, PTX80, PTX75, PTX100 = (
    (1, 90, payload(5)),
    (1, 80, payload(6)),
    (1, 75, payload(7)),
    (
        1,
        100,
        payload(8),
    ),
)

#: blob 0 has an sm_90 cubin (kept, nothing else); blob 1 only PTX <= 90 below
#: an sm_80/sm_89 cubin (highest PTX kept); blob 2 nothing an sm_90 GPU loads.
BLOBS = [
    [SM80_CUBIN, SM89_CUBIN, SM90_CUBIN, PTX90, SM100_CUBIN],
    [SM80_CUBIN, SM89_CUBIN, PTX75, PTX80, PTX100],
    [SM100_CUBIN, PTX100],
]


@pytest.fixture
def library(tmp_path: Path) -> Path:
    # padding between blobs, as the linker leaves it
    section = b"".join(fatbin_blob(b) + bytes(8) for b in BLOBS)
    path = tmp_path / "_C_stable_libtorch.abi3.so"
    path.write_bytes(elf_library(section))
    return path


def test_fatbin_lists_every_image(library: Path) -> None:
    found = fatbin.images(library.read_bytes())
    assert [(i.kind, i.arch) for i in found] == [(k, a) for b in BLOBS for k, a, _ in b]
    assert len({i.blob for i in found}) == 3
    assert fatbin.summary(library.read_bytes())["sm_90 cubin"] == (1, 64)


def test_prune_keeps_target_cubin_and_highest_ptx_and_zeroes_the_rest(
    library: Path, tmp_path: Path
) -> None:
    before = library.read_bytes()
    out = tmp_path / "pruned.so"
    report = fatbin.prune(library, out, 90)
    after = out.read_bytes()
    assert len(after) == len(before)
    kept = {(i.blob, i.kind, i.arch) for i in fatbin.images(before) if any(after[i.payload])}
    blobs = sorted({i.blob for i in fatbin.images(before)})
    assert kept == {(blobs[0], 2, 90), (blobs[1], 1, 80)}
    for image in fatbin.images(before):
        if (image.blob, image.kind, image.arch) in kept:
            assert after[image.payload] == before[image.payload]
        else:
            assert after[image.payload] == bytes(image.payload_size)
        # headers are untouched, so the driver sees the same table
        assert (
            after[image.offset : image.offset + image.header_size]
            == before[image.offset : image.offset + image.header_size]
        )
    assert report.kept_images == 2 and report.zeroed_images == 10
    assert report.blobs == 3 and report.blobs_without_target == 1
    # only payload bytes changed
    changed = [n for n, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    payloads = [i.payload for i in fatbin.images(before)]
    assert all(any(p.start <= n < p.stop for p in payloads) for n in changed)


def test_prune_for_another_major_keeps_its_own_cubins(library: Path, tmp_path: Path) -> None:
    fatbin.prune(library, tmp_path / "sm100.so", 100)
    after = (tmp_path / "sm100.so").read_bytes()
    kept = {(i.kind, i.arch) for i in fatbin.images(after) if any(after[i.payload])}
    assert kept == {(2, 100), (1, 100)}  # sm_100 cubins; blob 1's compute_100 PTX


def test_prune_refuses_non_cuda_and_targetless_libraries(tmp_path: Path) -> None:
    plain = tmp_path / "plain.so"
    plain.write_bytes(elf_library(b"\0" * 16, name=b".text"))
    with pytest.raises(HarnessError, match=r"no \.nv_fatbin"):
        fatbin.prune(plain, tmp_path / "out.so", 90)
    assert not fatbin.has_fatbin(plain)
    (tmp_path / "text.so").write_bytes(b"not an elf")
    with pytest.raises(HarnessError, match="not an ELF"):
        fatbin.prune(tmp_path / "text.so", tmp_path / "out.so", 90)
    blackwell = tmp_path / "blackwell.so"
    blackwell.write_bytes(elf_library(fatbin_blob([SM100_CUBIN, PTX100])))
    with pytest.raises(HarnessError, match="no device code for sm_90"):
        fatbin.prune(blackwell, tmp_path / "out.so", 90)


# --------------------------------------------------------------------------- tree patches

WARMUP = bundle.TREE_PATCHES[0][0]
WARMUP_SOURCE = (
    "def kernel_warmup(worker):\n"
    "    if current_platform.is_cuda():\n"
    "        # The MSA kernels, and the CuTe DSL their modules import, are CUDA-only.\n"
    + bundle.TREE_PATCHES[0][1]
)


def test_tree_patch_guards_the_minimax_warmup_import_exactly_once() -> None:
    files = {WARMUP: WARMUP_SOURCE.encode()}
    assert bundle.patch_tree(files) == [WARMUP]
    patched = files[WARMUP].decode()
    ast.parse(patched)
    assert "except ImportError" in patched and patched.count("minimax_m3_msa_warmup(worker)") == 1
    with pytest.raises(HarnessError, match="found it 0 times"):
        bundle.patch_tree(files)  # never twice


@pytest.mark.parametrize(
    "files",
    [
        {},
        {WARMUP: b"def kernel_warmup(worker):\n    pass\n"},
        {WARMUP: (WARMUP_SOURCE * 2).encode()},
    ],
)
def test_tree_patch_fails_loudly_when_upstream_changes(files: dict[str, bytes]) -> None:
    with pytest.raises(HarnessError, match=r"re-check|has no"):
        bundle.patch_tree(dict(files))


REAL_TREE = REPO / ".work" / "vllm"


@pytest.mark.skipif(
    not (REAL_TREE / WARMUP).exists(), reason="the pinned vLLM tree is not materialized"
)
def test_tree_patches_match_the_pinned_tree() -> None:
    files = {path: (REAL_TREE / path).read_bytes() for path, _, _ in bundle.TREE_PATCHES}
    bundle.patch_tree(files)
    for source in files.values():
        ast.parse(source)


# --------------------------------------------------------------------------- wheel + tree

VERSION = "1.0.0"


def release_wheel(path: Path, version: str = VERSION, kernels: bytes | None = None) -> Path:
    """A zip laid out like vLLM's release wheel, with small stand-ins."""
    info = f"vllm-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.4\nName: vllm\nVersion: {version}\n\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: false\n",
        f"{info}/entry_points.txt": "[console_scripts]\nvllm = vllm.cli:main\n",
        f"{info}/top_level.txt": "vllm\n",
        f"{info}/RECORD": "vllm/__init__.py,,\n",
        "vllm/__init__.py": "FROM_WHEEL = True\n",
        "vllm/third_party/triton_kernels/__init__.py": "",
        "vllm/third_party/triton_kernels/target_info.py": "TARGET = 1\n",
        "vllm/third_party/flashmla/flash_mla_interface.py": "MLA = 1\n",
        "vllm/third_party/deep_gemm/__init__.py": "DEEP = 1\n",
        "vllm/vllm-rs": "binary",
        "vllm/_flashmla_C.abi3.so": "other library",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
        lib = kernels or elf_library(b"".join(fatbin_blob(b) for b in BLOBS))
        for name in bundle.KERNEL_LIBRARIES:
            zf.writestr(name, lib)
    return path


TREE_VLLM = {
    "vllm/__init__.py": b"FROM_TREE = True\n",
    "vllm/layer.py": b"X = 1\n",
    WARMUP: WARMUP_SOURCE.encode(),
}


def test_python_tree_takes_tree_files_wheel_extras_and_dist_info(tmp_path: Path) -> None:
    with zipfile.ZipFile(release_wheel(tmp_path / "w.whl")) as wheel:
        files = bundle.python_tree({**TREE_VLLM, "tests/t.py": b""}, wheel, VERSION)
    assert files["vllm/__init__.py"] == b"FROM_TREE = True\n"  # the series wins
    assert "vllm/third_party/triton_kernels/target_info.py" in files
    assert "vllm/third_party/flashmla/flash_mla_interface.py" in files
    for absent in (
        "vllm/vllm-rs",
        "vllm/_flashmla_C.abi3.so",
        "tests/t.py",
        "vllm/third_party/deep_gemm/__init__.py",
        f"vllm-{VERSION}.dist-info/RECORD",
        *bundle.KERNEL_LIBRARIES,
    ):
        assert absent not in files
    assert sorted(n for n in files if ".dist-info/" in n) == sorted(
        f"vllm-{VERSION}.dist-info/{n}" for n in bundle.DIST_INFO_FILES
    )


def test_dist_info_lets_importlib_find_the_version(tmp_path: Path) -> None:
    with zipfile.ZipFile(release_wheel(tmp_path / "w.whl")) as wheel:
        files = bundle.python_tree(TREE_VLLM, wheel, VERSION)
    root = tmp_path / "py"
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    (dist,) = [d for d in importlib.metadata.distributions(path=[str(root)])]
    assert dist.metadata["Name"] == "vllm" and dist.version == VERSION


def test_dist_info_of_another_version_is_refused(tmp_path: Path) -> None:
    with (
        zipfile.ZipFile(release_wheel(tmp_path / "w.whl", version="9.9.9")) as wheel,
        pytest.raises(HarnessError, match=r"no vllm-1\.0\.0\.dist-info"),
    ):
        bundle.python_tree(TREE_VLLM, wheel, VERSION)


# --------------------------------------------------------------------------- tests selection


def test_select_tests_follows_imports_and_package_files() -> None:
    files = {
        "pyproject.toml": b"",
        "tests/__init__.py": b"",
        "tests/conftest.py": b"from tests.models.utils import helper\n",
        "tests/models/__init__.py": b"",
        "tests/models/utils.py": b"helper = 1\n",
        "tests/kernels/__init__.py": b"",
        "tests/kernels/conftest.py": b"",
        "tests/kernels/utils.py": b"from .quant_utils import q\n",
        "tests/kernels/quant_utils.py": b"q = 1\n",
        "tests/kernels/moe/__init__.py": b"",
        "tests/kernels/moe/test_a.py": (
            b"from tests.kernels.utils import x\nimport tests.kernels.nv\n"
        ),
        "tests/kernels/moe/test_other.py": b"",
        "tests/kernels/nv.py": b"from ..models import utils\n",
        "tests/unrelated/test_b.py": b"",
    }
    selected = bundle.select_tests(files, ["tests/kernels/moe/test_a.py"])
    assert "tests/kernels/moe/test_other.py" not in selected
    assert "tests/unrelated/test_b.py" not in selected
    assert set(selected) == set(files) - {
        "tests/kernels/moe/test_other.py",
        "tests/unrelated/test_b.py",
    }
    with pytest.raises(HarnessError, match="not in the tree"):
        bundle.select_tests(files, ["tests/missing.py"])


# --------------------------------------------------------------------------- wheels


def test_default_lists_parse_and_resolve() -> None:
    pins = bundle.read_wheel_list(bundle.DEFAULT_WHEEL_LIST)
    target = bundle.read_target_packages(bundle.DEFAULT_TARGET_PACKAGES)
    assert target["torch"] == "2.11.0" and target["typing-extensions"] is None
    needed = {p.name for p in bundle.needed_wheels(pins, target)}
    assert {"pydantic", "pyzmq", "llguidance", "tblib"} <= needed
    assert {"typing-extensions", "anyio"} <= needed  # marked always: version unknown
    assert not {bundle.normalize(p.name) for p in pins if not p.always} & set(target)


def test_needed_wheels_skips_what_the_target_has() -> None:
    pins = [
        bundle.WheelPin("Absent", "1.0"),
        bundle.WheelPin("same", "2.0"),
        bundle.WheelPin("other_version", "3.0"),
        bundle.WheelPin("unknown-version", "4.0"),
        bundle.WheelPin("forced", "5.0", always=True),
    ]
    target = {"same": "2.0", "other-version": "2.9", "unknown-version": None, "forced": None}
    assert [p.name for p in bundle.needed_wheels(pins, target)] == [
        "Absent",
        "other_version",
        "forced",
    ]


def test_lists_are_validated(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("good==1\nnot a name\n")
    with pytest.raises(HarnessError, match=r"bad\.txt:2"):
        bundle.read_target_packages(bad)
    dupes = tmp_path / "dupes.toml"
    dupes.write_text(
        '[[wheel]]\nname = "A_b"\nversion = "1"\n[[wheel]]\nname = "a-b"\nversion = "2"\n'
    )
    with pytest.raises(HarnessError, match="listed twice"):
        bundle.read_wheel_list(dupes)


def test_pip_download_command_targets_the_device_python() -> None:
    cmd = bundle.pip_download_command(
        bundle.WheelPin("llguidance", "1.7.6", platform="manylinux_2_31_x86_64"), Path("/c")
    )
    assert cmd[-1] == "llguidance==1.7.6"
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert platforms[0] == "manylinux_2_31_x86_64" and "manylinux_2_28_x86_64" in platforms


def tiny_wheel(
    folder: Path, name: str = "tinydep", version: str = "1.0", requires: str = ""
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}\n"
    record = f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "VALUE = 7\n")
        zf.writestr(f"{info}/METADATA", metadata)
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", record)
    return path


def test_unmet_requirements_are_reported(tmp_path: Path) -> None:
    reqs = (
        "Requires-Dist: present\nRequires-Dist: missing>=1\n"
        'Requires-Dist: oldpy; python_version < "3.10"\nRequires-Dist: opt; extra == "x"'
    )
    wheel = tiny_wheel(tmp_path, requires=reqs)
    assert bundle.unmet_requirements([wheel], ["present"]) == {wheel.name: ["missing>=1"]}


# --------------------------------------------------------------------------- build


WHEEL_LIST = '[[wheel]]\nname = "tinydep"\nversion = "1.0"\nwhy = "test"\n'

TEST_FILE = """import pytest


def test_passes():
    assert True


def test_skips():
    pytest.skip("no GPU here")


def test_fails():
    assert 1 == 2, "arithmetic"
"""


@pytest.fixture
def ready(project: Project, commit: CommitFn, tmp_path: Path) -> Project:
    """The conftest project plus a release wheel, a cached dependency and a series commit."""
    wheel = release_wheel(project.cache / "dist" / "vllm-1.0.0-none.whl")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    pin = project.patches / "base.toml"
    pin.write_text(pin.read_text().replace('wheel_sha256 = "0"', f'wheel_sha256 = "{digest}"'))
    tiny_wheel(project.cache / "wheels" / "cp312-manylinux-x86_64")
    (tmp_path / "wheels.toml").write_text(WHEEL_LIST)
    (tmp_path / "target.txt").write_text("torch==2.11.0\n")
    commit(
        "[Kernel] Add a device test",
        {
            WARMUP: WARMUP_SOURCE,
            "tests/__init__.py": "",
            "tests/kernels/__init__.py": "",
            "tests/kernels/test_device.py": TEST_FILE,
            # run by path from a test, not imported: must travel all the same
            "tests/kernels/device_checks.py": "CHECKS = 1\n",
            "pyproject.toml": "[tool.pytest.ini_options]\nmarkers = []\n",
        },
    )
    return project


def build(project: Project, tmp_path: Path, **kwargs: object) -> bundle.Bundle:
    return bundle.build_bundle(
        project,
        out=tmp_path / "out" / ".bundle",
        target_packages=tmp_path / "target.txt",
        wheel_list=tmp_path / "wheels.toml",
        **kwargs,  # type: ignore[arg-type]
    )


def test_build_writes_manifest_provenance_and_archives(ready: Project, tmp_path: Path) -> None:
    built = build(ready, tmp_path)
    out = built.path
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == sorted(
        [
            "MANIFEST.txt",
            "provenance.json",
            "device_run.py",
            "vllm-py.tar.xz",
            "tests.tar.xz",
            "kernels-_C_stable_libtorch.tar.xz",
            "kernels-_moe_C_stable_libtorch.tar.xz",
            "kernels-_vllm_fa3_C.tar.xz",
            "wheels/tinydep-1.0-py3-none-any.whl",
        ]
    )
    assert built.total_bytes == bundle.folder_size(out)
    rows = [
        line.split("  ")
        for line in (out / "MANIFEST.txt").read_text().splitlines()
        if not line.startswith("#")
    ]
    assert sorted(r[2] for r in rows) == [n for n in names if n != "MANIFEST.txt"]
    for digest, size, rel in rows:
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == digest
        assert (out / rel).stat().st_size == int(size)
    prov = json.loads((out / "provenance.json").read_text())
    tree_head = ready.tree / ".git"
    assert prov["base"]["version"] == VERSION and prov["target"]["sm"] == 90
    assert prov["tree"]["commit"] != prov["base"]["base_commit"]
    assert len(prov["series_hash"]) == 12 and tree_head.exists()
    assert prov["contents"]["tests"]["series"] == ["tests/kernels/test_device.py"]
    assert prov["contents"]["wheels"]["carried"] == ["tinydep-1.0-py3-none-any.whl"]
    kernels = prov["contents"]["kernels"]
    assert [k["pruned"]["kept_images"] for k in kernels] == [2, 2, 2]
    assert [k["name"] for k in kernels] == list(bundle.KERNEL_LIBRARIES)
    with tarfile.open(out / "vllm-py.tar.xz") as tar:
        members = tar.getnames()
    assert "vllm-1.0.0.dist-info/METADATA" in members
    assert "vllm/third_party/triton_kernels/target_info.py" in members
    with tarfile.open(out / "tests.tar.xz") as tar:
        assert set(tar.getnames()) == {
            "pyproject.toml",
            "tests/__init__.py",
            "tests/kernels/__init__.py",
            "tests/kernels/device_checks.py",
            "tests/kernels/test_device.py",
        }
    assert (out / "device_run.py").read_bytes() == Path(device_run.__file__).read_bytes()


def test_a_bundle_of_another_revision_names_no_series_hash(
    ready: Project, commit: CommitFn, tmp_path: Path
) -> None:
    probe = git(ready.tree, "rev-parse", "series").stdout.strip()  # e.g. a series less one commit
    commit("[Kernel] A later commit", {"vllm/later.py": "X = 1\n"})
    built = build(ready, tmp_path, revision=probe)
    assert built.provenance["tree"] == {"revision": probe, "commit": probe}
    assert "series_hash" not in built.provenance  # the hash names patches/, not this tree
    assert len(build(ready, tmp_path).provenance["series_hash"]) == 12  # the series' head


def test_bundles_of_two_revisions_share_their_kernel_archives(
    ready: Project, tmp_path: Path
) -> None:
    rows = {rel: digest for rel, _, digest in bundle.manifest(build(ready, tmp_path).path)}
    # A later commit, committed later: its archives' mtime is another.
    (ready.tree / "vllm" / "later.py").write_text("X = 1\n")
    git(ready.tree, "add", "--all")
    env = {**IDENTITY.env(), "GIT_COMMITTER_DATE": "2030-01-01T00:00:00+00:00"}
    git(ready.tree, "commit", "-q", "-m", f"Later\n\n{IDENTITY.signoff}\n", env=env)
    later = {rel: digest for rel, _, digest in bundle.manifest(build(ready, tmp_path).path)}
    kernels = [name for name in rows if name.startswith("kernels-")]
    assert len(kernels) == len(bundle.KERNEL_LIBRARIES)
    assert all(later[name] == rows[name] for name in kernels)
    assert later["vllm-py.tar.xz"] != rows["vllm-py.tar.xz"]


def test_build_is_deterministic(ready: Project, tmp_path: Path) -> None:
    first = (build(ready, tmp_path).path / "MANIFEST.txt").read_text()
    second = (build(ready, tmp_path).path / "MANIFEST.txt").read_text()
    assert first == second


def test_build_over_the_limit_fails_and_leaves_nothing(ready: Project, tmp_path: Path) -> None:
    with pytest.raises(HarnessError, match="over the limit") as info:
        build(ready, tmp_path, max_bytes=10_000)
    assert "vllm-py.tar.xz" in str(info.value)
    assert not (tmp_path / "out" / ".bundle").exists()
    assert not list(ready.work.glob("bundle-staging-*"))


def test_build_refuses_a_foreign_output_folder(ready: Project, tmp_path: Path) -> None:
    foreign = tmp_path / "out" / ".bundle"
    foreign.mkdir(parents=True)
    (foreign / "precious.txt").write_text("keep")
    with pytest.raises(HarnessError, match="not a device bundle"):
        build(ready, tmp_path)
    assert (foreign / "precious.txt").read_text() == "keep"


def test_build_carries_extra_kernels_with_their_namespace(ready: Project, tmp_path: Path) -> None:
    extra = tmp_path / "libmarlin_series.so"
    extra.write_bytes(elf_library(fatbin_blob([SM90_CUBIN, SM80_CUBIN])))
    kernel = bundle.ExtraKernel.parse(f"{extra}:marlin_series")
    prov = build(ready, tmp_path, extra_kernels=[kernel]).provenance
    record = prov["contents"]["kernels"][-1]  # type: ignore[index]
    assert record["namespace"] == "marlin_series"
    assert record["name"] == "kernels/marlin_series/libmarlin_series.so"
    assert record["pruned"]["zeroed_images"] == 1
    with pytest.raises(HarnessError, match="PATH:NAMESPACE"):
        bundle.ExtraKernel.parse("just-a-path.so")


def test_a_series_that_changes_kernels_needs_them_or_stock_kernels(
    ready: Project, commit: CommitFn, tmp_path: Path
) -> None:
    commit("[Kernel] Change a kernel", {"csrc/moe/marlin.cu": "// changed\n"})
    refused = r"(?s)csrc/moe/marlin\.cu\n.*--kernel .*--stock-kernels"
    with pytest.raises(HarnessError, match=refused):
        build(ready, tmp_path)
    assert not (tmp_path / "out" / ".bundle").exists()
    assert build(ready, tmp_path, stock_kernels=True).path.is_dir()
    extra = tmp_path / "libmarlin_series.so"
    extra.write_bytes(elf_library(fatbin_blob([SM90_CUBIN])))
    build(ready, tmp_path, extra_kernels=[bundle.ExtraKernel.parse(f"{extra}:marlin_series")])


# --------------------------------------------------------------------------- device side


def test_device_run_needs_nothing_but_the_standard_library() -> None:
    tree = ast.parse(Path(device_run.__file__).read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module.split(".")[0])
    assert top <= set(sys.stdlib_module_names) | {"__future__"}


def test_device_run_installs_only_the_wheels_the_manifest_lists(
    ready: Project, tmp_path: Path
) -> None:
    out_bundle = build(ready, tmp_path).path
    # A stale file an earlier bundle could have left: pip would fail on it.
    (out_bundle / "wheels" / "stale-0.1-py3-none-any.whl").write_bytes(b"not a wheel")
    logged: list[str] = []
    record = device_run.install(out_bundle, tmp_path / "prefix", logged.append)
    assert record["status"] == "passed"
    assert record["unlisted_wheels"] == ["stale-0.1-py3-none-any.whl"]
    assert any("stale-0.1-py3-none-any.whl" in line for line in logged)
    assert (tmp_path / "prefix" / "site" / "tinydep" / "__init__.py").exists()


def test_device_run_installs_runs_pytest_and_reports_skips_and_failures(
    ready: Project, tmp_path: Path
) -> None:
    out_bundle = build(ready, tmp_path).path
    prefix, out = tmp_path / "prefix", tmp_path / "results"
    code = device_run.main(
        [
            "--bundle",
            str(out_bundle),
            "--prefix",
            str(prefix),
            "--out",
            str(out),
            "--skip-smoke",
            "--replay",
            "-c 'import tinydep, sys; sys.exit(tinydep.VALUE - 7)'",
            "--time-limit",
            "600",
        ]
    )
    assert results.validate(out / "results.json") == []  # the project's result schema
    record = json.loads((out / "results.json").read_text())
    assert (record["schema"], record["kind"]) == (results.SCHEMA, "device-run")
    built = json.loads((out_bundle / "provenance.json").read_text())
    prov = record["provenance"]
    assert prov["base"] == {
        k: built["base"][k] for k in ("version", "sdist_sha256", "upstream_commit", "base_commit")
    }
    assert prov["series_hash"] == built["series_hash"]
    assert prov["tree_commit"] == built["tree"]["commit"]
    assert prov["command"].startswith("device_run.py --bundle ")
    assert prov["python"] == platform.python_version() and prov["host"] == platform.node()
    data = record["data"]
    assert code == 1 and data["ok"] is False
    assert data["install"]["status"] == "passed"
    assert (prefix / "py" / "vllm-1.0.0.dist-info" / "METADATA").exists()
    assert (prefix / "py" / bundle.KERNEL_LIBRARIES[0]).exists()
    assert (prefix / "site" / "tinydep" / "__init__.py").exists()
    # byte-compiled once at install: the children run with PYTHONDONTWRITEBYTECODE
    tag = sys.implementation.cache_tag
    assert (prefix / "site" / "tinydep" / "__pycache__" / f"__init__.{tag}.pyc").exists()
    assert list((prefix / "py" / "vllm").glob(f"**/__pycache__/*.{tag}.pyc"))
    assert data["smoke"]["status"] == "not-run"
    py = data["pytest"]
    assert (py["passed"], py["failed"], py["errors"], py["skipped"]) == (1, 1, 0, 1)
    assert py["status"] == "failed"
    assert py["skipped_tests"][0]["reason"].endswith("no GPU here")
    assert py["failed_tests"][0]["test"].endswith("test_fails")
    assert data["replays"][0]["status"] == "passed"  # the carried wheel imports
    assert data["bundle"]["tree"]["commit"] == built["tree"]["commit"]
    assert {"python", "date_utc"} <= set(data["host"])
    assert (out / "junit.xml").exists() and (out / "pytest.log").exists()

    # a skip-only selection is "skipped", never "passed"
    code = device_run.main(
        [
            "--bundle",
            str(out_bundle),
            "--prefix",
            str(prefix),
            "--out",
            str(out),
            "--skip-smoke",
            "-k",
            "skips",
        ]
    )
    data = json.loads((out / "results.json").read_text())["data"]
    assert data["pytest"]["status"] == "skipped" and data["ok"] is False and code == 1


def test_device_run_refuses_a_tampered_bundle_and_a_foreign_prefix(
    ready: Project, tmp_path: Path
) -> None:
    out_bundle = build(ready, tmp_path).path
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data").write_text("keep")
    code = device_run.main(
        [
            "--bundle",
            str(out_bundle),
            "--prefix",
            str(foreign),
            "--out",
            str(tmp_path / "r1"),
        ]
    )
    assert code == 1 and (foreign / "data").read_text() == "keep"
    # a failed install still writes a well-formed result file
    assert results.validate(tmp_path / "r1" / "results.json") == []
    assert (
        "not made by device_run.py"
        in json.loads((tmp_path / "r1" / "results.json").read_text())["data"]["install"]["error"]
    )
    wheel = out_bundle / "wheels" / "tinydep-1.0-py3-none-any.whl"
    wheel.chmod(0o644)
    wheel.write_bytes(wheel.read_bytes() + b"x")
    code = device_run.main(
        [
            "--bundle",
            str(out_bundle),
            "--prefix",
            str(tmp_path / "p"),
            "--out",
            str(tmp_path / "r2"),
        ]
    )
    record = json.loads((tmp_path / "r2" / "results.json").read_text())["data"]
    assert code == 1 and record["install"]["status"] == "failed"
    assert "tinydep" in record["install"]["error"] and record["smoke"]["status"] == "not-run"


def test_environment_puts_the_bundle_first_and_turns_off_the_flashinfer_sampler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    provenance = {
        "contents": {"kernels": [{"name": "kernels/ns/lib.so", "namespace": "ns"}]},
        "tree": {"commit": "abc123"},
    }
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    env = device_run.environment(tmp_path / "p", tmp_path / "o", provenance)
    assert env["PYTHONPATH"].split(":") == [
        str(tmp_path / "p" / "py"),
        str(tmp_path / "p" / "site"),
        "/elsewhere",
    ]
    assert env["VLLM_BUNDLE_EXTRA_KERNELS"] == str(tmp_path / "p" / "py" / "kernels/ns/lib.so")
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"  # FlashInfer does not travel
    assert env[device_run.BUNDLE_TREE_ENV] == "abc123"
    monkeypatch.setenv(device_run.BUNDLE_SERIES_ENV, "outer")  # not this bundle's
    probe = device_run.environment(tmp_path, tmp_path, provenance)  # a bundle of another revision
    assert device_run.BUNDLE_SERIES_ENV not in probe
    series = device_run.environment(tmp_path, tmp_path, {**provenance, "series_hash": "s1"})
    assert series[device_run.BUNDLE_SERIES_ENV] == "s1"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")  # a host that has it
    assert (
        device_run.environment(tmp_path, tmp_path, provenance)["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    )


@pytest.fixture
def child_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A file the child device_run starts touches once its Python runs; until then (or
    until it exits) device_run's Popen does not return, so the child's time limit starts
    when the child does, however long a loaded host takes to start a Python."""
    marker = tmp_path / "child-started"
    popen = subprocess.Popen

    def popen_once_started(*args: Any, **kwargs: Any) -> subprocess.Popen[str]:
        proc = popen(*args, **kwargs)
        until = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < until:
            time.sleep(0.01)
        return proc

    monkeypatch.setattr(device_run.subprocess, "Popen", popen_once_started)
    return marker


def test_a_time_limited_replay_ends_within_the_limit_even_when_it_ignores_sigint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, child_started: Path
) -> None:
    # Session 13 lost a run to this: the cut replay got SIGINT at the limit and its
    # SIGKILL came 30 s later, after the device call's own limit had ended the call.
    # SIGINT comes at 3 s, SIGKILL at 4.5 s; the limit, at 14.5 s, leaves a loaded host
    # 10 s, and SIGINT at the limit itself (no wrap-up kept back) would end past it.
    monkeypatch.setattr(device_run, "KILL_GRACE_S", 1.5)
    monkeypatch.setattr(device_run, "WRAP_UP_S", 11.5)
    stubborn = (
        "-c 'import os, pathlib, signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        f'pathlib.Path("{child_started}").touch(); '
        f'print(os.environ["{device_run.TIME_LEFT_ENV}"], flush=True); time.sleep(60)' + "'"
    )
    deadline = time.monotonic() + 14.5
    (record,) = device_run.run_replays(
        {"PATH": "/usr/bin:/bin"}, tmp_path, [stubborn], timeout=600, deadline=deadline
    )
    assert time.monotonic() < deadline  # within the limit, SIGKILL included
    assert record["status"] == "timed-out" and record["exit_code"] == -signal.SIGKILL
    log = (tmp_path / "replay-1.log").read_text()
    assert "reached: SIGINT" in log
    given = float(log.splitlines()[1])
    assert 1.0 < given <= 3.0  # the child was told when its SIGINT comes (not 14.5 or 600)


def test_steps_with_no_time_left_are_not_started(tmp_path: Path) -> None:
    pytest_record = device_run.run_pytest({}, tmp_path, tmp_path, ["t.py"], None, [], timeout=0)
    assert pytest_record["status"] == "timed-out" and pytest_record["passed"] == 0
    assert pytest_record["note"] == "not started: no time left"
    smoke_record = device_run.run_smoke({}, tmp_path, timeout=-1.0)
    assert smoke_record["status"] == "timed-out" and smoke_record["checks"] == []
    assert not (tmp_path / "pytest.log").exists() and not (tmp_path / "smoke.log").exists()
    deadline = time.monotonic() + device_run.WRAP_UP_S + 100
    assert 90 < device_run.time_left(600, deadline) <= 100  # the wrap-up kept back
    assert device_run.time_left(50, deadline) == 50 and device_run.time_left(7, None) == 7


def test_main_gives_smoke_and_pytest_what_the_time_limit_leaves(
    ready: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_bundle = build(ready, tmp_path).path
    given: dict[str, float] = {}
    counts = {"passed": 1, "failed": 0, "errors": 0, "skipped": 0}

    def smoke(env: object, out: object, timeout: float) -> dict[str, object]:
        given["smoke"] = timeout
        return {"status": "passed", "checks": []}

    def tests(*args: object, timeout: float = 0.0) -> dict[str, object]:
        given["pytest"] = timeout
        return {"status": "passed", **counts, "skipped_tests": [], "failed_tests": []}

    monkeypatch.setattr(device_run, "run_smoke", smoke)
    monkeypatch.setattr(device_run, "run_pytest", tests)
    argv = ["--bundle", str(out_bundle), "--prefix", str(tmp_path / "p"), "--out"]
    limit = device_run.WRAP_UP_S + 100
    assert device_run.main([*argv, str(tmp_path / "o"), "--time-limit", str(limit)]) == 0
    assert 50 < given["smoke"] <= 100 and 50 < given["pytest"] <= 100  # not 300 and 600
    with pytest.raises(SystemExit):  # a limit that leaves no step any time is refused
        device_run.main([*argv, str(tmp_path / "o2"), "--time-limit", "30"])


def test_the_time_left_variable_is_the_one_the_e2e_runner_reads() -> None:
    assert device_run.TIME_LEFT_ENV == e2e.TIME_LEFT_ENV


def test_device_run_repeats_the_result_schema_of_harness_results() -> None:
    # device_run.py cannot import harness.results on the GPU host; its copy must not drift.
    assert (device_run.SCHEMA, device_run.REQUIRED) == (results.SCHEMA, results.REQUIRED)
    assert (device_run.BUNDLE_TREE_ENV, device_run.BUNDLE_SERIES_ENV) == (
        results.BUNDLE_TREE_ENV,
        results.BUNDLE_SERIES_ENV,
    )
    prov = device_run.result_provenance("device_run.py", "2026-01-01T00:00:00+00:00", {}, {})
    assert set(results.REQUIRED) <= set(prov)
    assert (prov["gpu"], prov["driver"], prov["torch"], prov["cuda"]) == (
        "none",
        "none",
        "unknown",
        "unknown",
    )
    assert "series_hash" not in prov and "tree_commit" not in prov


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        ([], ("none", "none")),
        (["NVIDIA H200, 580.159.04, 143771 MiB"], ("NVIDIA H200", "580.159.04")),
        (["NVIDIA H200, 580.1, 1 MiB", "NVIDIA H200, 580.1, 1 MiB"], ("2x NVIDIA H200", "580.1")),
        (["A, 1.0, 1 MiB", "B, 1.0, 1 MiB"], ("2x A; B", "1.0")),
    ],
)
def test_gpu_and_driver_read_like_harness_results(
    lines: list[str], expected: tuple[str, str]
) -> None:
    assert device_run._gpu_and_driver(lines) == expected


def test_smoke_without_a_gpu_fails_rather_than_passes(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ""}
    record = device_run.run_smoke(env, tmp_path, timeout=120)
    assert record["status"] == "failed"
    assert record["checks"] and record["checks"][0]["status"] == "failed"
    assert not any(c["status"] == "passed" for c in record["checks"][2:])


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.a" name="test_ok" time="0.1"/>
<testcase classname="tests.a" name="test_skip">
  <skipped type="pytest.skip" message="needs sm_100"/></testcase>
<testcase classname="tests.a" name="test_bad">
  <failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.b" name="test_err"><error message="fixture broke"/></testcase>
<testcase classname="tests.b" name="test_xfail">
  <skipped type="pytest.xfail" message="known"/></testcase>
</testsuite></testsuites>
"""


def test_parse_junit_counts_each_outcome(tmp_path: Path) -> None:
    (tmp_path / "j.xml").write_text(JUNIT)
    record = device_run.parse_junit(tmp_path / "j.xml")
    assert (record["passed"], record["failed"], record["errors"], record["skipped"]) == (1, 1, 1, 2)
    assert record["skipped_tests"][0] == {"test": "tests.a::test_skip", "reason": "needs sm_100"}
    assert [f["kind"] for f in record["failed_tests"]] == ["failure", "error"]


@pytest.mark.parametrize(
    ("counts", "code", "timed_out", "status"),
    [
        ({"passed": 3}, 0, False, "passed"),
        ({"passed": 3, "skipped": 2}, 0, False, "passed"),
        ({"passed": 0, "skipped": 2}, 0, False, "skipped"),
        ({}, 5, False, "no-tests"),
        ({"passed": 3, "failed": 1}, 1, False, "failed"),
        ({"passed": 3, "errors": 1}, 1, False, "failed"),
        ({"passed": 3}, 2, False, "failed"),  # interrupted or a usage error
        ({"passed": 3}, 0, True, "timed-out"),
    ],
)
def test_pytest_status_never_counts_skips_as_passes(
    counts: dict[str, int], code: int, timed_out: bool, status: str
) -> None:
    assert device_run.pytest_status(counts, code, timed_out) == status


def test_device_run_interrupts_at_the_time_limit(tmp_path: Path, child_started: Path) -> None:
    log = io.StringIO()
    child = f"import pathlib, time; pathlib.Path({str(child_started)!r}).touch(); "
    code, timed_out = device_run._run_logged(
        [sys.executable, "-c", child + "print('start', flush=True); time.sleep(60)"],
        env={"PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        log=log,
        timeout=1,
    )
    assert timed_out and code != 0
    assert "start" in log.getvalue() and "time limit" in log.getvalue()


def test_replays_share_the_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_run, "WRAP_UP_S", 1.0)
    env = {"PATH": "/usr/bin:/bin"}
    sleeper = "-c 'import time; time.sleep(60)'"
    started = time.monotonic()
    # 5 s for the first replay and the second's start (a loaded host starts Pythons slowly)
    records = device_run.run_replays(
        env, tmp_path, ["-c pass", sleeper, "-c pass"], timeout=600, deadline=started + 6
    )
    assert time.monotonic() - started < 40  # cut at the deadline, not at the 600 s timeout
    assert [r["status"] for r in records] == ["passed", "timed-out", "timed-out"]
    assert records[1]["log"] == "replay-2.log" and records[1]["exit_code"] != 0
    assert records[2] == {
        "command": "-c pass",
        "exit_code": None,
        "status": "timed-out",
        "seconds": 0.0,
        "note": "not started: no time left",
    }
    assert not (tmp_path / "replay-3.log").exists()


def _wheel_with_payload(folder: Path, name: str, size: int, seed: int) -> Path:
    """A wheel holding ``size`` stored (uncompressed) pseudo-random bytes."""
    path = tiny_wheel(folder, name)
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(f"{name}/blob.bin", hashlib.shake_256(bytes([seed])).digest(size))
    return path


GROUP_LIST = """
[[wheel]]
name = "plain"
version = "1.0"

[[wheel]]
name = "big_a"
version = "1.0"
group = "fi"

[[wheel]]
name = "big_b"
version = "1.0"
group = "fi"
"""


def test_a_wheel_group_travels_in_parts_and_joins_byte_for_byte(
    project: Project, tmp_path: Path
) -> None:
    cache = project.cache / "wheels" / "cp312-manylinux-x86_64"
    wheels = [
        _wheel_with_payload(cache, "big_a", 1_500_000, 1),
        _wheel_with_payload(cache, "big_b", 700_000, 2),
    ]
    listing = tmp_path / "wheels.toml"
    listing.write_text(GROUP_LIST)
    pins = bundle.read_wheel_list(listing)
    # A group's wheels never ride in the bundle itself.
    assert [p.name for p in bundle.needed_wheels(pins, {})] == ["plain"]
    out = tmp_path / "parts"
    folder, manifest = bundle.build_wheel_parts(
        project, "fi", out=out, wheel_list=listing, part_bytes=bundle.MiB
    )
    assert folder == out
    parts = [p["name"] for p in manifest["parts"]]
    assert parts == ["part-01", "part-02", "part-03"]
    assert all((out / p).stat().st_size <= bundle.MiB for p in parts)
    assert sorted(p.name for p in out.iterdir()) == ["part-01", "part-02", "part-03", "parts.json"]

    # On the host: each call copies its part into one folder; the last joins them.
    host = tmp_path / "host"
    host.mkdir()
    for name in ["parts.json", *parts]:
        (host / name).write_bytes((out / name).read_bytes())
    joined = device_run.join_wheel_parts(host, tmp_path / "prefix" / "parts")
    assert [p.name for p in joined] == sorted(w.name for w in wheels)
    for path in joined:
        assert path.read_bytes() == (cache / path.name).read_bytes()

    (host / "part-02").unlink()
    with pytest.raises(device_run.BundleError, match=r"1 of 3 parts .* missing \(part-02\)"):
        device_run.join_wheel_parts(host, tmp_path / "again")
    changed = bytearray((out / "part-02").read_bytes())
    changed[100] ^= 1
    (host / "part-02").write_bytes(bytes(changed))
    with pytest.raises(device_run.BundleError, match="part-02 do not match"):
        device_run.join_wheel_parts(host, tmp_path / "again")
    with pytest.raises(HarnessError, match="no wheel group 'nope'; its groups: fi"):
        bundle.build_wheel_parts(project, "nope", out=out, wheel_list=listing)


def test_wheel_parts_are_cut_to_what_a_call_leaves_beside_the_tree(
    project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = project.cache / "wheels" / "cp312-manylinux-x86_64"
    _wheel_with_payload(cache, "big_a", 1_500_000, 1)
    _wheel_with_payload(cache, "big_b", 700_000, 2)
    listing = tmp_path / "wheels.toml"
    listing.write_text(GROUP_LIST)
    # A tree that leaves 2.5 MiB of a call; less the 1 MiB margin, whole MiB: parts of 1 MiB.
    call = bundle.CALL_BYTES
    monkeypatch.setattr(bundle, "travelling_tree_bytes", lambda root: call - 5 * bundle.MiB // 2)
    _, manifest = bundle.build_wheel_parts(project, "fi", out=tmp_path / "p", wheel_list=listing)
    assert [p["bytes"] <= bundle.MiB for p in manifest["parts"]] == [True] * 3
    assert manifest["parts"][0]["bytes"] == bundle.MiB
    # A tree that leaves no room for a part is refused with the call's size.
    monkeypatch.setattr(bundle, "travelling_tree_bytes", lambda root: call - bundle.MiB)
    with pytest.raises(
        HarnessError, match=rf"too small: .* \(a call carries {call // bundle.MiB} MiB"
    ):
        bundle.build_wheel_parts(project, "fi", out=tmp_path / "q", wheel_list=listing)


def test_pth_paths_reports_what_the_pth_files_of_a_target_folder_add(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "extra_dir").mkdir(parents=True)
    assert device_run.pth_paths(site) == []
    added = tmp_path / "added_by_import"
    (site / "a.pth").write_text(f"extra_dir\nimport sys; sys.path.insert(0, {str(added)!r})\n")
    assert sorted(device_run.pth_paths(site)) == sorted([str(added), str(site / "extra_dir")])


def test_device_run_installs_a_joined_wheel_group_and_its_pth_paths(
    ready: Project, tmp_path: Path
) -> None:
    # A wheel whose .pth puts a folder inside its package on sys.path, as the
    # CUTLASS DSL's does; it travels as a group, in parts, not in the bundle.
    cache = ready.cache / "wheels" / "cp312-manylinux-x86_64"
    wheel = _wheel_with_payload(cache, "pthdep", 300_000, 3)
    with zipfile.ZipFile(wheel, "a") as zf:
        zf.writestr("pthdep/inner/hidden_mod.py", "HIDDEN = 1\n")
        zf.writestr(
            "pthdep_paths.pth",
            "import os, sys, pthdep; "
            "sys.path.insert(0, os.path.join(pthdep.__path__[0], 'inner'))\n",
        )
    listing = tmp_path / "groups.toml"
    listing.write_text('[[wheel]]\nname = "pthdep"\nversion = "1.0"\ngroup = "g"\n')
    parts = tmp_path / "parts"
    bundle.build_wheel_parts(ready, "g", out=parts, wheel_list=listing, part_bytes=bundle.MiB)
    out_bundle = build(ready, tmp_path).path
    out = tmp_path / "results"
    code = device_run.main(
        [
            "--bundle",
            str(out_bundle),
            "--prefix",
            str(tmp_path / "prefix"),
            "--out",
            str(out),
            "--skip-smoke",
            "--skip-tests",
            "--wheel-parts",
            str(parts),
            "--replay",
            "-c 'import hidden_mod, tinydep; assert hidden_mod.HIDDEN == 1'",
        ]
    )
    data = json.loads((out / "results.json").read_text())["data"]
    assert data["install"]["wheel_parts"] == ["pthdep-1.0-py3-none-any.whl"]
    assert data["install"]["wheels"] == 2
    assert data["replays"][0]["status"] == "passed", data["replays"]
    assert code == 0


# --- carry plan ---------------------------------------------------------------------------------


def carry_repo(tmp_path: Path, bundle_sizes: dict[str, int], tree: dict[str, int]) -> Path:
    """A git checkout with ``tree`` (tracked) files and an ignored ``.bundle``."""
    from harness.project import git

    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    (root / ".gitignore").write_text("/.bundle/\n/ignored.bin\n")
    for name, size in tree.items():
        (root / name).write_bytes(b"t" * size)
    git(root, "add", "-A")
    (root / "untracked.txt").write_bytes(b"u" * 100)
    (root / "ignored.bin").write_bytes(b"i" * 10_000)
    folder = root / ".bundle"
    folder.mkdir()
    for name, size in bundle_sizes.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"b" * size)
    return root


BUNDLE_SIZES = {
    "MANIFEST.txt": 10,
    "device_run.py": 40,
    "provenance.json": 10,
    "kernels-_C.tar.xz": 500,
    "kernels-_moe_C.tar.xz": 400,
    "vllm-py.tar.xz": 200,
    "tests.tar.xz": 20,
    "wheels/a.whl": 150,
    "wheels/b.whl": 150,
}


def test_the_tree_counts_tracked_and_untracked_files_but_not_ignored_ones(tmp_path: Path) -> None:
    root = carry_repo(tmp_path, BUNDLE_SIZES, {"a.txt": 1000})
    gitignore = len((root / ".gitignore").read_bytes())
    assert bundle.travelling_tree_bytes(root) == 1000 + 100 + gitignore


def test_a_bundle_that_fits_travels_whole_in_one_call(tmp_path: Path) -> None:
    root = carry_repo(tmp_path, BUNDLE_SIZES, {"a.txt": 1000})
    plan = bundle.plan_carry(root, root / ".bundle", call_bytes=10_000)
    assert plan.staged == () and plan.final == (".bundle",)
    assert plan.bundle_bytes == sum(BUNDLE_SIZES.values())
    assert plan.final_prefix == "" and "one call, carry ['.bundle']" in plan.describe()


def test_an_oversized_bundle_sends_its_largest_entries_ahead(tmp_path: Path) -> None:
    root = carry_repo(tmp_path, BUNDLE_SIZES, {"a.txt": 1000})
    tree = bundle.travelling_tree_bytes(root)
    limit = tree + 850  # the whole bundle is 1480 bytes
    plan = bundle.plan_carry(root, root / ".bundle", call_bytes=limit)
    sizes = {f".bundle/{k}": v for k, v in BUNDLE_SIZES.items()}
    sizes[".bundle/wheels"] = 300
    # Largest first until the rest fits: _C (500) ahead; 980 left > 850, so _moe_C
    # too; together they are over one call, so each has its own.
    assert plan.staged == ((".bundle/kernels-_C.tar.xz",), (".bundle/kernels-_moe_C.tar.xz",))
    assert ".bundle/device_run.py" in plan.final and ".bundle/MANIFEST.txt" in plan.final
    carried = [p for call in plan.staged for p in call] + list(plan.final)
    assert sorted(carried) == sorted(
        [p for p in sizes if not p.startswith(".bundle/wheels/")]
    )  # every entry once, the wheels folder as one path
    for call in (*plan.staged, plan.final):
        assert tree + sum(sizes[p] for p in call) <= limit
    staged = bundle.STAGED_DIR
    # The first call empties the staging folder: nothing of an earlier bundle
    # is copied back; the last call copies back exactly this plan's entries.
    assert plan.stage_command(0) == (
        f"rm -rf {staged} && mkdir -p {staged} && cp -r .bundle/kernels-_C.tar.xz {staged}/"
    )
    assert plan.stage_command(1) == (
        f"mkdir -p {staged} && cp -r .bundle/kernels-_moe_C.tar.xz {staged}/"
    )
    assert plan.final_prefix == (
        f"cp -r {staged}/kernels-_C.tar.xz {staged}/kernels-_moe_C.tar.xz .bundle/ && "
    )
    assert "3 calls in a row" in plan.describe()


def test_entries_sent_ahead_share_a_call_when_they_fit(tmp_path: Path) -> None:
    root = carry_repo(tmp_path, BUNDLE_SIZES, {"a.txt": 1000})
    tree = bundle.travelling_tree_bytes(root)
    plan = bundle.plan_carry(root, root / ".bundle", call_bytes=tree + 950)
    assert plan.staged == ((".bundle/kernels-_C.tar.xz", ".bundle/kernels-_moe_C.tar.xz"),)


def test_a_tree_that_leaves_no_room_is_an_error_naming_the_entry(tmp_path: Path) -> None:
    root = carry_repo(tmp_path, BUNDLE_SIZES, {"a.txt": 1000})
    tree = bundle.travelling_tree_bytes(root)
    with pytest.raises(HarnessError, match=r"kernels-_C\.tar\.xz"):
        bundle.plan_carry(root, root / ".bundle", call_bytes=tree + 450)
    with pytest.raises(HarnessError, match="not inside"):
        bundle.plan_carry(root, tmp_path, call_bytes=1 << 30)


def test_the_runner_manifest_and_provenance_always_travel_with_the_last_call(
    tmp_path: Path,
) -> None:
    sizes = {**BUNDLE_SIZES, "device_run.py": 600, "provenance.json": 450}
    root = carry_repo(tmp_path, sizes, {"a.txt": 1000})
    tree = bundle.travelling_tree_bytes(root)
    plan = bundle.plan_carry(root, root / ".bundle", call_bytes=tree + 1100)
    ahead = {p for call in plan.staged for p in call}
    assert {".bundle/device_run.py", ".bundle/provenance.json", ".bundle/MANIFEST.txt"} <= set(
        plan.final
    )
    assert not ahead & set(plan.final)
    with pytest.raises(HarnessError, match="no plan keeps the last call"):
        bundle.plan_carry(root, root / ".bundle", call_bytes=tree + 1000)


def test_more_entries_go_ahead_when_the_last_call_would_name_too_many_paths(
    tmp_path: Path,
) -> None:
    sizes = {**BUNDLE_SIZES, **{f"extra-{i}.tar.xz": 1 for i in range(5)}}
    root = carry_repo(tmp_path, sizes, {"a.txt": 1000})
    tree = bundle.travelling_tree_bytes(root)
    plan = bundle.plan_carry(root, root / ".bundle", call_bytes=tree + 1000, call_paths=8)
    # By bytes moving _C (500) and _moe_C (400) would do; 12 paths would be
    # left, so the smallest go ahead too, and share the call planned for those.
    assert len(plan.final) <= 8
    assert all(len(call) <= 8 for call in plan.staged)
    carried = sorted(p for call in (*plan.staged, plan.final) for p in call)
    assert len(carried) == len(set(carried)) == 13  # the wheels folder as one path
    assert len(plan.staged) == 1


def test_paths_over_the_limit_go_ahead_as_small_entries_not_a_call_more(
    tmp_path: Path,
) -> None:
    # The 0.34.0 bundle's shape: two large entries ahead fill a call by bytes; one
    # more path must go too, and the smallest fits beside them.
    sizes = {**BUNDLE_SIZES, "kernels-fa3.tar.xz": 470, "marlin.tar.xz": 30, "extra.tar.xz": 5}
    root = carry_repo(tmp_path, sizes, {"a.txt": 1000})
    tree = bundle.travelling_tree_bytes(root)
    plan = bundle.plan_carry(root, root / ".bundle", call_bytes=tree + 1100, call_paths=8)
    assert len(plan.staged) == 1 and len(plan.final) == 8
    assert plan.staged[0] == (
        ".bundle/extra.tar.xz",
        ".bundle/kernels-_C.tar.xz",
        ".bundle/kernels-fa3.tar.xz",
    )


def test_a_shared_folder_travels_even_when_ignored(tmp_path: Path) -> None:
    root = carry_repo(tmp_path, BUNDLE_SIZES, {"a.txt": 1000})
    before = bundle.travelling_tree_bytes(root)
    (root / ".gitignore").write_text("/.bundle/\n/ignored.bin\n/shared/\n")
    (root / "shared").mkdir()
    (root / "shared" / "seed.md").write_bytes(b"s" * 300)
    assert bundle.travelling_tree_bytes(root) == before + 300 + len("/shared/\n")


def test_the_bundle_command_warns_when_no_plan_exists(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from harness import __main__ as cli

    built = bundle.Bundle(tmp_path / "b", 5, {})
    monkeypatch.setattr(bundle, "build_bundle", lambda project, **kw: built)

    def no_plan(root: Path, folder: Path) -> bundle.CarryPlan:
        raise HarnessError("is not inside")

    monkeypatch.setattr(bundle, "plan_carry", no_plan)
    args = cli.parser().parse_args(["bundle", "--out", str(tmp_path / "b")])
    project = SimpleNamespace(root=tmp_path)
    assert cli._cmd_bundle(project, args) == 0  # type: ignore[arg-type]
    assert "warning: no carry plan: is not inside" in capsys.readouterr().err
