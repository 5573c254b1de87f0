"""Device bundle: the patched vLLM tree, its kernels, tests and wheels for an offline GPU host.

The GPU host the series is tested on (an H200 with Python 3.12 and torch 2.11,
see ``docs/device-bundle.md``) has no network, and a device call carries at
most 64 MiB of files. :func:`build_bundle` writes one folder (default
``<repo>/.bundle``, ignored by git) that holds everything such a call needs,
and refuses to finish if that folder is larger than ``max_bytes`` (60 MiB by
default). On the host, ``python3 .bundle/device_run.py`` (a copy of
:mod:`harness.device_run`) installs it under a prefix, runs a kernel smoke
check, the series' GPU tests and replay scripts, and writes a results JSON.

Contents (each archive is a deterministic ``tar.xz``: sorted names, fixed
mtime, no owners, so the same inputs give the same bytes):

``vllm-py.tar.xz``
    ``vllm/`` from ``git archive`` of a revision of the materialized tree
    (branch ``series`` by default), so the series' Python changes are in it;
    plus, from the pinned release wheel, the files the sdist lacks but vLLM
    imports (:data:`WHEEL_EXTRAS`) and ``vllm-<version>.dist-info``.
``kernels-<name>.tar.xz``
    The release wheel's two stable-ABI kernel libraries (:data:`KERNEL_LIBRARIES`)
    pruned to the target architecture by :mod:`harness.fatbin`, and any extra
    libraries given (a series' kernel-subset builds), each with the
    ``torch.ops`` namespace it registers. The release's libraries take the
    wheel's timestamp, not the revision's, so bundles of two revisions share
    these archives byte for byte (a second bundle on a host needs only its
    other files carried).
``tests.tar.xz``
    The test files the series adds or changes, any extra tests asked for, and
    everything they import from ``tests.`` (plus each directory's
    ``__init__.py``/``conftest.py`` and vLLM's ``pyproject.toml`` for pytest's
    markers).
``wheels/``
    The dependency wheels the target lacks (:func:`needed_wheels`), fetched with
    ``pip download --only-binary=:all:`` for CPython 3.12 manylinux x86_64 into
    the cache (``<cache>/wheels``) and copied from there.
``device_run.py``, ``provenance.json``, ``MANIFEST.txt``
    The on-target runner; what the bundle was built from (base pin, series hash,
    tree commit, target) and what it contains; sizes and sha256 of every file.

Three things differ from a normal install of the release wheel; each is
checked by ``tests/test_bundle.py``:

1. **The MiniMax-M3 warmup import is guarded** (:data:`TREE_PATCHES`). vLLM
   0.34.0's ``kernel_warmup`` imports ``minimax_m3_msa_warmup`` on every CUDA
   server, and that module imports the CuTe DSL (``cutlass``, from
   nvidia-cutlass-dsl and its CUDA flavour, 97 MB of wheels: more than a device
   call carries beside the rest). The warmup returns at once for a model without
   MiniMax-M3 sparse attention; the bundle skips it, with a log line, when the
   import fails. The patch matches the upstream text exactly once or the build
   fails.
2. **dist-info.** ``vllm/platforms/__init__.py`` asks
   ``importlib.metadata.version("vllm")`` while probing for CUDA; without a
   dist-info it raises ``PackageNotFoundError``, which is swallowed, and vLLM
   silently runs on ``UnspecifiedPlatform``. The wheel's ``METADATA``,
   ``WHEEL``, ``entry_points.txt`` and ``top_level.txt`` are carried next to
   ``vllm/`` (``RECORD`` is not: the files differ from the wheel's), and the
   build checks that the version matches the pin.
3. **Kernel pruning.** See :mod:`harness.fatbin`: the libraries keep only the
   device code the target GPU loads, so they work on that architecture only.

FlashAttention 3 travels (its library is one of :data:`KERNEL_LIBRARIES`), so
served runs use vLLM's default attention backend on Hopper, as users do; the
FA2 library, which Hopper does not use, does not.
"""

from __future__ import annotations

import ast
import calendar
import dataclasses
import io
import json
import lzma
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath
from typing import Any

from harness import fatbin
from harness.base import base_commit, fetch
from harness.build import compiled_changes
from harness.device_run import PARTS_MANIFEST, WHEELS_TAR
from harness.patches import series_hash
from harness.project import HarnessError, Project, git, progress, sha256_file
from harness.touched import touched_files, touched_tests

MiB = 1 << 20
#: Room a wheel part leaves in its call beside the working tree (which grows with results/).
PART_MARGIN_BYTES = MiB
DEFAULT_MAX_BYTES = 60 * MiB
DEFAULT_TARGET_SM = 90
DEFAULT_PYTHON = "3.12"
DATA = Path(__file__).resolve().parent / "data"
DEFAULT_TARGET_PACKAGES = DATA / "h200-packages.txt"
DEFAULT_WHEEL_LIST = DATA / "device-wheels.toml"
DEVICE_RUNNER = Path(__file__).resolve().parent / "device_run.py"

#: The stable-ABI kernel libraries of the release wheel that travel, pruned.
#: ``_C`` is needed to import vLLM on CUDA at all (``platforms/cuda.py``
#: imports it, ``w8a8_utils`` queries its ops at import); ``_moe_C`` holds the
#: MoE kernels (Marlin MoE, topk_softmax, align/sort); ``_vllm_fa3_C`` is
#: FlashAttention 3, vLLM's default attention on Hopper (without an FA library
#: ``vllm_flash_attn`` refuses to import, and attention falls back to Triton).
KERNEL_LIBRARIES = (
    "vllm/_C_stable_libtorch.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
)

#: Files of the release wheel that the sdist's ``vllm/`` lacks and that vLLM
#: imports on the CUDA path. Everything else the wheel adds is left out: the
#: other ``.so`` files (optional, imported under try/except or by their own
#: backends; FA2's library among them, unused on Hopper), ``vllm-rs`` (the
#: Rust frontend), ``third_party/{deep_gemm,fmha_sm100,tml_fa4}`` and
#: ``vllm_flash_attn/cute`` (FA4, for Blackwell).
WHEEL_EXTRAS = ("vllm/third_party/triton_kernels/", "vllm/third_party/flashmla/")

#: Edits to tree files that travel (path, upstream text, replacement), each applied
#: exactly once (see the module doc).
TREE_PATCHES = (
    (
        "vllm/model_executor/warmup/kernel_warmup.py",
        "        from vllm.model_executor.warmup.minimax_m3_msa_warmup import (\n"
        "            minimax_m3_msa_warmup,\n"
        "        )\n"
        "\n"
        "        minimax_m3_msa_warmup(worker)\n",
        "        # device bundle: the CuTe DSL this module imports does not travel\n"
        "        # (harness/bundle.py); the warmup is a no-op without MiniMax-M3.\n"
        "        try:\n"
        "            from vllm.model_executor.warmup.minimax_m3_msa_warmup import (\n"
        "                minimax_m3_msa_warmup,\n"
        "            )\n"
        "        except ImportError as exc:\n"
        '            logger.info("device bundle: MiniMax-M3 MSA warmup skipped: %s", exc)\n'
        "        else:\n"
        "            minimax_m3_msa_warmup(worker)\n",
    ),
)

#: The dist-info files carried (RECORD is left out: it lists the wheel's files).
DIST_INFO_FILES = ("METADATA", "WHEEL", "entry_points.txt", "top_level.txt")

#: vLLM test support carried with any test selection (as the team's prototype did).
TEST_SUPPORT = (
    "pyproject.toml",
    "tests/__init__.py",
    "tests/conftest.py",
    "tests/utils.py",
    "tests/ci_envs.py",
    "tests/models/__init__.py",
    "tests/models/utils.py",
    "tests/models/registry.py",
    "tests/quantization/__init__.py",
    "tests/quantization/utils.py",
)


#: manylinux tags pip may pick for the target (x86_64, glibc 2.39 image).
MANYLINUX_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

_NAME_NORMALIZE = re.compile(r"[-_.]+")
_ARCHIVE_MODE_FILE = 0o644
_ARCHIVE_MODE_EXEC = 0o755


def normalize(name: str) -> str:
    """PEP 503 project-name normalization (``Typing_Extensions`` -> ``typing-extensions``)."""
    return _NAME_NORMALIZE.sub("-", name).lower()


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class ExtraKernel:
    """A kernel library built by the series (e.g. a kernel subset), and its op namespace."""

    path: Path
    namespace: str

    @classmethod
    def parse(cls, value: str) -> ExtraKernel:
        """Parse ``PATH:NAMESPACE``, the form ``scripts/marlin_*.py`` and the series'
        ``VLLM_TEST_MARLIN_MOE_LIB`` take too."""
        path, sep, namespace = value.rpartition(":")
        if not sep or not namespace.isidentifier() or not path:
            raise HarnessError(
                f"expected PATH:NAMESPACE for an extra kernel library, got {value!r}"
            )
        return cls(Path(path).resolve(), namespace)


@dataclasses.dataclass(frozen=True)
class WheelPin:
    """One dependency the target needs, from ``device-wheels.toml``."""

    name: str
    version: str
    why: str = ""
    platform: str | None = None
    always: bool = False
    #: Pins of a group never travel in the bundle: ``bundle --wheel-group NAME``
    #: splits them into parts for several device calls (:func:`build_wheel_parts`).
    group: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


def read_target_packages(path: Path) -> dict[str, str | None]:
    """Read a target package list: ``{normalized name: version or None}``.

    One package a line, ``NAME`` or ``NAME==VERSION``; blank lines and ``#``
    comments are ignored.
    """
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise HarnessError(f"cannot read the target package list {path}: {exc}") from exc
    packages: dict[str, str | None] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()) or (
            sep and not version.strip()
        ):
            raise HarnessError(f"{path}:{number}: expected NAME or NAME==VERSION, got {raw!r}")
        packages[normalize(name.strip())] = version.strip() or None
    return packages


def read_wheel_list(path: Path) -> list[WheelPin]:
    """Read ``device-wheels.toml``: the pinned packages the bundle may need to carry."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HarnessError(f"cannot read the wheel list {path}: {exc}") from exc
    pins = []
    for entry in data.get("wheel", []):
        try:
            pins.append(WheelPin(**entry))
        except TypeError as exc:
            raise HarnessError(f"{path}: bad [[wheel]] entry {entry}: {exc}") from exc
    names = [normalize(p.name) for p in pins]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise HarnessError(f"{path}: packages listed twice: {dupes} (one version of each)")
    return pins


def needed_wheels(pins: Sequence[WheelPin], target: Mapping[str, str | None]) -> list[WheelPin]:
    """The pins to carry: those the target lacks, has at another version, or marked ``always``.

    Pins of a ``group`` are never carried here (see :func:`build_wheel_parts`).

    A target package whose version is unknown counts as present (the image's
    own is used); mark a pin ``always`` when the image's version may be too old.
    """
    needed = []
    for pin in pins:
        if pin.group is not None:
            continue
        have = target.get(normalize(pin.name), "missing")
        if pin.always or have == "missing" or (have is not None and have != pin.version):
            needed.append(pin)
    return needed


def pip_download_command(
    pin: WheelPin, dest: Path, python_version: str = DEFAULT_PYTHON
) -> list[str]:
    """The ``pip download`` command that fetches ``pin``'s wheel for the target."""
    platforms = ([pin.platform] if pin.platform else []) + list(MANYLINUX_PLATFORMS)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "--dest",
        str(dest),
    ]
    for platform in platforms:
        cmd += ["--platform", platform]
    return [*cmd, pin.requirement]


def _wheel_name_version(filename: str) -> tuple[str, str]:
    parts = filename[: -len(".whl")].split("-")
    return normalize(parts[0]), parts[1]


def cached_wheel(cache: Path, pin: WheelPin) -> Path | None:
    """The wheel for ``pin`` already in ``cache``, if any."""
    want = (normalize(pin.name), pin.version)
    found = sorted(p for p in cache.glob("*.whl") if _wheel_name_version(p.name) == want)
    return found[0] if found else None


def fetch_wheels(
    project: Project, pins: Sequence[WheelPin], python_version: str = DEFAULT_PYTHON
) -> list[Path]:
    """Return the cached wheel of every pin, downloading the missing ones with pip."""
    cache = project.cache / "wheels" / f"cp{python_version.replace('.', '')}-manylinux-x86_64"
    cache.mkdir(parents=True, exist_ok=True)
    paths = []
    for pin in pins:
        wheel = cached_wheel(cache, pin)
        if wheel is None:
            progress(f"downloading the wheel of {pin.requirement}")
            proc = subprocess.run(
                pip_download_command(pin, cache, python_version),
                capture_output=True,
                text=True,
                check=False,
            )
            wheel = cached_wheel(cache, pin)
            if proc.returncode != 0 or wheel is None:
                raise HarnessError(
                    f"pip could not download a cp{python_version} manylinux wheel of "
                    f'{pin.requirement} (add `platform = "manylinux_2_N_x86_64"` to its '
                    f"entry if it is built for a newer glibc):\n{proc.stderr.strip()}"
                )
        paths.append(wheel)
    return paths


def unmet_requirements(
    wheels: Sequence[Path], present: Iterable[str], python_version: str = DEFAULT_PYTHON
) -> dict[str, list[str]]:
    """Requirements of the carried wheels that neither they nor the target provide.

    Reads each wheel's ``Requires-Dist``; extras and requirements whose
    environment marker is false for CPython ``python_version`` on Linux are
    skipped. The result is informative (recorded in ``provenance.json``): a
    package vLLM never imports on the tested paths may well be missing.
    """
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # pip, which fetches the wheels, always vendors it
        from pip._vendor.packaging.requirements import (  # type: ignore[no-redef]
            InvalidRequirement,
            Requirement,
        )

    environment = {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    provided = {normalize(n) for n in present} | {_wheel_name_version(w.name)[0] for w in wheels}
    unmet: dict[str, list[str]] = {}
    for wheel in wheels:
        for line in _wheel_metadata(wheel).get_all("Requires-Dist") or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate(environment):
                continue
            if normalize(req.name) not in provided:
                unmet.setdefault(wheel.name, []).append(str(req))
    return unmet


def _wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return HeaderParser().parsestr(zf.read(name).decode("utf-8", "replace"))


# --------------------------------------------------------------------------- tree changes


def patch_tree(files: dict[str, bytes]) -> list[str]:
    """Apply :data:`TREE_PATCHES` to ``files`` in place; return the paths changed.

    Raises:
        HarnessError: a patched file is missing, or its upstream text is not there
            exactly once (it changed, or is already patched): re-check the patch.
    """
    changed = []
    for path, old, new in TREE_PATCHES:
        if path not in files:
            raise HarnessError(f"the tree has no {path}, which harness.bundle patches")
        source = files[path].decode()
        if (count := source.count(old)) != 1:
            raise HarnessError(
                f"{path}: expected the text harness.bundle patches exactly once, found it "
                f"{count} times; the upstream file changed (or is already patched): re-check "
                f"TREE_PATCHES"
            )
        files[path] = source.replace(old, new).encode()
        changed.append(path)
    return changed


def dist_info(wheel: zipfile.ZipFile, version: str) -> dict[str, bytes]:
    """The carried ``vllm-<version>.dist-info`` files of the release wheel, by archive name.

    Raises:
        HarnessError: the wheel has no such dist-info, or its METADATA names
            another project or version.
    """
    folder = f"vllm-{version}.dist-info"
    files: dict[str, bytes] = {}
    for name in DIST_INFO_FILES:
        try:
            files[f"{folder}/{name}"] = wheel.read(f"{folder}/{name}")
        except KeyError as exc:
            raise HarnessError(f"the release wheel has no {folder}/{name}") from exc
    meta = HeaderParser().parsestr(files[f"{folder}/METADATA"].decode())
    if meta["Name"] != "vllm" or meta["Version"] != version:
        raise HarnessError(
            f"{folder}/METADATA says {meta['Name']} {meta['Version']}, expected vllm {version}"
        )
    return files


def wheel_extras(wheel: zipfile.ZipFile) -> dict[str, bytes]:
    """The :data:`WHEEL_EXTRAS` files of the release wheel, by archive name."""
    files = {
        info.filename: wheel.read(info)
        for info in wheel.infolist()
        if not info.is_dir() and info.filename.startswith(WHEEL_EXTRAS)
    }
    for prefix in WHEEL_EXTRAS:
        if not any(name.startswith(prefix) for name in files):
            raise HarnessError(f"the release wheel has nothing under {prefix}")
    return files


def python_tree(
    tree_files: Mapping[str, bytes], wheel: zipfile.ZipFile, version: str
) -> dict[str, bytes]:
    """The carried Python package: the tree's ``vllm/`` + wheel extras + dist-info.

    Files of the tree always win over the wheel's (the series may change them);
    :data:`TREE_PATCHES` are applied.
    """
    files = {n: b for n, b in tree_files.items() if n.startswith("vllm/")}
    patch_tree(files)
    for name, data in wheel_extras(wheel).items():
        files.setdefault(name, data)
    files.update(dist_info(wheel, version))
    return files


# --------------------------------------------------------------------------- tests


def _module_files(module: str, files: Mapping[str, bytes]) -> list[str]:
    base = module.replace(".", "/")
    return [c for c in (f"{base}.py", f"{base}/__init__.py") if c in files]


def _imports(name: str, source: bytes) -> set[str]:
    """Absolute module names ``name`` imports (relative imports resolved)."""
    try:
        tree = ast.parse(source, filename=name)
    except SyntaxError:
        return set()
    package = PurePosixPath(name).parent.as_posix().replace("/", ".")
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            modules.add(base)
            modules.update(f"{base}.{alias.name}" for alias in node.names)
    return modules


def select_tests(files: Mapping[str, bytes], roots: Iterable[str]) -> list[str]:
    """The test files to carry: ``roots`` plus :data:`TEST_SUPPORT` and all they import.

    ``files`` maps repository paths (``tests/kernels/moe/test_moe.py``) to
    contents. Every module under ``tests.`` that a carried file imports is
    carried, and so is each ``__init__.py`` and ``conftest.py`` on the way
    from ``tests/`` down to a carried file.

    Raises:
        HarnessError: a root is not in ``files``.
    """
    roots = list(roots)
    if missing := [r for r in roots if r not in files]:
        raise HarnessError(f"tests not in the tree: {', '.join(missing)}")
    queue = roots + [s for s in TEST_SUPPORT if s in files]
    selected: set[str] = set()
    while queue:
        name = queue.pop()
        if name in selected:
            continue
        selected.add(name)
        parts = PurePosixPath(name).parts
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            queue += [
                f"{folder}/{f}" for f in ("__init__.py", "conftest.py") if f"{folder}/{f}" in files
            ]
        if name.endswith(".py"):
            for module in _imports(name, files[name]):
                if module == "tests" or module.startswith("tests."):
                    queue += _module_files(module, files)
    return sorted(selected)


# --------------------------------------------------------------------------- archives


@dataclasses.dataclass(frozen=True)
class Member:
    """One file to put into an archive."""

    data: bytes
    executable: bool = False


def git_files(tree: Path, commit: str, paths: Sequence[str]) -> dict[str, Member]:
    """The files under ``paths`` at ``commit`` of ``tree`` (through ``git archive``)."""
    proc = subprocess.run(
        ["git", "-C", str(tree), "archive", "--format=tar", commit, "--", *paths],
        capture_output=True,
        check=False,
        env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull},
    )
    if proc.returncode != 0:
        raise HarnessError(f"git archive {commit} failed in {tree}: {proc.stderr.decode().strip()}")
    files: dict[str, Member] = {}
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        for info in tar:
            if info.isfile():
                extracted = tar.extractfile(info)
                assert extracted is not None
                files[info.name] = Member(extracted.read(), bool(info.mode & 0o111))
            elif info.issym():
                raise HarnessError(
                    f"{info.name} is a symbolic link; the bundle carries plain files"
                )
    return files


def write_archive(
    path: Path, members: Mapping[str, Member | bytes], mtime: int, preset: int = 9
) -> None:
    """Write ``members`` as a deterministic ``tar.xz`` at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with (
        lzma.open(path, "wb", preset=preset | lzma.PRESET_EXTREME) as xz,
        tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for name in sorted(members):
            member = members[name]
            if isinstance(member, bytes):
                member = Member(member)
            info = tarfile.TarInfo(name)
            info.size = len(member.data)
            info.mtime = mtime
            info.mode = _ARCHIVE_MODE_EXEC if member.executable else _ARCHIVE_MODE_FILE
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(member.data))


def manifest(folder: Path) -> list[tuple[str, int, str]]:
    """``(relative path, size, sha256)`` of every file under ``folder`` but the manifest."""
    rows = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel != "MANIFEST.txt":
            rows.append((rel, path.stat().st_size, sha256_file(path)))
    return rows


def write_manifest(folder: Path) -> int:
    """Write ``MANIFEST.txt`` (``sha256  size  path`` lines and a total); return the total size."""
    rows = manifest(folder)
    lines = ["# sha256  bytes  path (device_run.py checks these before installing)"]
    lines += [f"{digest}  {size}  {rel}" for rel, size, digest in rows]
    body_total = sum(size for _, size, _ in rows)
    text = "\n".join(lines) + "\n"
    # The total includes MANIFEST.txt itself; its own line states the other files.
    footer = f"# total bytes of the files above: {body_total}\n"
    (folder / "MANIFEST.txt").write_text(text + footer)
    return body_total + len((text + footer).encode())


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- build


@dataclasses.dataclass(frozen=True)
class Bundle:
    """A built bundle: where it is, how large, and what it was built from."""

    path: Path
    total_bytes: int
    provenance: dict[str, object]


def _staging(project: Project, out: Path) -> Path:
    """A fresh staging folder in the (ignored) work area; an existing ``out`` must be a bundle."""
    if out.exists() and any(out.iterdir()) and not (out / "provenance.json").exists():
        raise HarnessError(
            f"{out} exists and is not a device bundle; move it away (nothing was changed)"
        )
    project.work.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="bundle-staging-", dir=project.work))


def default_out(project: Project) -> Path:
    """Where a bundle is built unless told otherwise: ``<repo>/.bundle`` (ignored by git)."""
    return project.root / ".bundle"


def build_bundle(
    project: Project,
    *,
    out: Path | None = None,
    revision: str = "series",
    target_sm: int = DEFAULT_TARGET_SM,
    tests: Sequence[str] = (),
    series_tests: bool = True,
    extra_kernels: Sequence[ExtraKernel] = (),
    stock_kernels: bool = False,
    target_packages: Path = DEFAULT_TARGET_PACKAGES,
    wheel_list: Path = DEFAULT_WHEEL_LIST,
    python_version: str = DEFAULT_PYTHON,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Bundle:
    """Build the device bundle (``python -m harness bundle``).

    Args:
        project: The harness project (pin, cache, materialized tree).
        out: Bundle folder; default ``<repo>/.bundle``. Replaced if it holds a
            bundle; refused if it holds anything else.
        revision: Revision of the materialized tree whose ``vllm/`` and tests
            travel (default the ``series`` branch).
        target_sm: GPU architecture the kernel libraries are pruned to (90 = H200).
        tests: Extra test files (repository paths) to carry besides the
            series' own.
        series_tests: Carry the test files ``base..revision`` adds or changes.
        extra_kernels: Kernel libraries built by the series, with their
            ``torch.ops`` namespaces.
        stock_kernels: Build a bundle without any extra kernel library although
            the series changes compiled sources (its kernel tests then fail on
            the release's kernels).
        target_packages: The target's installed packages (``NAME[==VERSION]``).
        wheel_list: The pinned dependencies (``device-wheels.toml``).
        python_version: The target's Python (``X.Y``) for the wheel downloads.
        max_bytes: Refuse a bundle larger than this.

    Returns:
        The built :class:`Bundle`.

    Raises:
        HarnessError: a missing input, a patch that no longer matches, a failed
            download, or a bundle over ``max_bytes`` (nothing is left at ``out``).
    """
    out = (out or default_out(project)).resolve()
    pin = project.pin
    tree = project.tree
    if not (tree / ".git").exists():
        raise HarnessError(f"{tree} is not materialized; run `python -m harness apply` first")
    commit = git(tree, "rev-parse", "--verify", f"{revision}^{{commit}}").stdout.strip()
    # The series hash names patches/; it describes the packed tree only when that
    # tree is the series branch's head, not an earlier commit or a probe branch.
    is_series = commit == git(tree, "rev-parse", "--verify", "series^{commit}").stdout.strip()
    base = base_commit(tree, pin.release)
    changed = compiled_changes(tree, base, commit, paths=("csrc/",))
    if changed and not extra_kernels and not stock_kernels:
        raise HarnessError(
            f"{revision} changes compiled sources, and the bundle would carry only the "
            "release's kernels:\n  " + "\n  ".join(changed) + "\nBuild the series' "
            "kernels (`python -m harness kernels --rev series --namespace marlin_series "
            "--arch 9.0`), carry them with `--kernel .work/kernels/libmarlin_series.so:"
            "marlin_series` and set VLLM_TEST_MARLIN_MOE_LIB on the host "
            "(docs/device-bundle.md), or pass --stock-kernels to bundle without them."
        )
    mtime = int(git(tree, "log", "-1", "--format=%ct", commit).stdout.strip())
    wheel_path = fetch(project, pin.wheel, pin.wheel_sha256)

    staging = _staging(project, out)
    try:
        contents = _assemble(
            project,
            staging,
            commit=commit,
            base=base,
            mtime=mtime,
            wheel_path=wheel_path,
            target_sm=target_sm,
            tests=tests,
            series_tests=series_tests,
            extra_kernels=extra_kernels,
            target_packages=target_packages,
            wheel_list=wheel_list,
            python_version=python_version,
        )
        provenance: dict[str, object] = {
            "schema": 1,
            "base": {
                "version": pin.release.version,
                "tag": pin.release.tag,
                "sdist_sha256": pin.release.sdist_sha256,
                "upstream_commit": pin.upstream_commit,
                "wheel": pin.wheel,
                "wheel_sha256": pin.wheel_sha256,
                "base_commit": base,
            },
            "tree": {"revision": revision, "commit": commit},
            "target": {
                "sm": target_sm,
                "python": python_version,
                "packages": target_packages.name,
                "packages_sha256": sha256_file(target_packages),
            },
            "contents": contents,
        }
        if is_series:
            provenance["series_hash"] = series_hash(project)
        (staging / "provenance.json").write_text(
            json.dumps(provenance, indent=2, sort_keys=True) + "\n"
        )
        shutil.copy2(DEVICE_RUNNER, staging / "device_run.py")
        total = write_manifest(staging)
        if total > max_bytes:
            sizes = "\n".join(f"  {size:>12,}  {rel}" for rel, size, _ in manifest(staging))
            raise HarnessError(
                f"the bundle is {total:,} bytes ({total / MiB:.1f} MiB), over the limit of "
                f"{max_bytes:,} bytes ({max_bytes / MiB:.1f} MiB); nothing was written to "
                f"{out}. Carry fewer tests or extra kernels, or fewer wheels:\n{sizes}"
            )
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    progress(f"bundle {out}: {total:,} bytes ({total / MiB:.1f} MiB)")
    return Bundle(out, total, provenance)


def _assemble(
    project: Project,
    staging: Path,
    *,
    commit: str,
    base: str,
    mtime: int,
    wheel_path: Path,
    target_sm: int,
    tests: Sequence[str],
    series_tests: bool,
    extra_kernels: Sequence[ExtraKernel],
    target_packages: Path,
    wheel_list: Path,
    python_version: str,
) -> dict[str, object]:
    """Write every archive and wheel into ``staging``; return the ``contents`` record."""
    tree = project.tree
    version = project.pin.release.version
    contents: dict[str, object] = {}

    progress(f"packing vllm/ of {commit[:12]} with the wheel's extras and dist-info")
    source = git_files(tree, commit, ["vllm"])
    with zipfile.ZipFile(wheel_path) as wheel:
        py_files = python_tree({n: m.data for n, m in source.items()}, wheel, version)
        # Unchanged tree files keep their mode; patched and wheel files are plain.
        members = {
            n: source[n] if n in source and source[n].data == b else Member(b)
            for n, b in py_files.items()
        }
        write_archive(staging / "vllm-py.tar.xz", members, mtime)
        contents["python"] = {
            "archive": "vllm-py.tar.xz",
            "files": len(members),
            "dist_info": f"vllm-{version}.dist-info",
            "patched": [path for path, _, _ in TREE_PATCHES],
        }

        kernels = []
        with tempfile.TemporaryDirectory() as tmp:
            for name in KERNEL_LIBRARIES:
                progress(f"pruning {name} to sm_{target_sm}")
                raw = Path(tmp) / PurePosixPath(name).name
                raw.write_bytes(wheel.read(name))
                stamp = calendar.timegm(wheel.getinfo(name).date_time)
                kernels.append(_pack_kernel(staging, raw, name, None, target_sm, stamp))
                raw.unlink()
    for extra in extra_kernels:
        if not extra.path.is_file():
            raise HarnessError(f"extra kernel library {extra.path} does not exist")
        progress(f"packing {extra.path.name} (torch.ops.{extra.namespace})")
        name = f"kernels/{extra.namespace}/{extra.path.name}"
        kernels.append(_pack_kernel(staging, extra.path, name, extra.namespace, target_sm, mtime))
    contents["kernels"] = kernels

    test_roots = list(tests)
    series = touched_tests(tree, base, commit) if series_tests else []
    test_roots += [t for t in series if t not in test_roots]
    # Helpers and data the series adds beside its tests travel too (a test may
    # run them by path, which the import closure cannot see); only test_*.py
    # files are handed to pytest.
    support = (
        [f for f in touched_files(tree, base, commit) if f not in series] if series_tests else []
    )
    progress(f"packing {len(test_roots)} test file(s) and their support files")
    test_sources = git_files(tree, commit, ["tests", "pyproject.toml"])
    carried = select_tests({n: m.data for n, m in test_sources.items()}, test_roots + support)
    write_archive(staging / "tests.tar.xz", {n: test_sources[n] for n in carried}, mtime)
    contents["tests"] = {
        "archive": "tests.tar.xz",
        "selected": test_roots,
        "series": series,
        "files": len(carried),
    }

    pins = read_wheel_list(wheel_list)
    target = read_target_packages(target_packages)
    needed = needed_wheels(pins, target)
    wheels = fetch_wheels(project, needed, python_version)
    (staging / "wheels").mkdir()
    for path in wheels:
        shutil.copy2(path, staging / "wheels" / path.name)
    contents["wheels"] = {
        "carried": [p.name for p in wheels],
        "not_carried_present_on_target": sorted(p.requirement for p in pins if p not in needed),
        "unmet_requirements": unmet_requirements(wheels, target, python_version),
    }
    return contents


def _pack_kernel(
    staging: Path, library: Path, name: str, namespace: str | None, target_sm: int, mtime: int
) -> dict[str, object]:
    """Prune ``library`` (when it has device code) and archive it as ``name``."""
    archive = f"kernels-{namespace or PurePosixPath(name).name.split('.')[0]}.tar.xz"
    if (staging / archive).exists():
        raise HarnessError(f"two kernel libraries would share {archive}; one library a namespace")
    record: dict[str, object] = {
        "name": name,
        "archive": archive,
        "namespace": namespace,
        "source_sha256": sha256_file(library),
    }
    with tempfile.TemporaryDirectory() as tmp:
        pruned = Path(tmp) / library.name
        if fatbin.has_fatbin(library):
            report = fatbin.prune(library, pruned, target_sm)
            record["pruned"] = report.to_json()
        else:
            shutil.copy2(library, pruned)
            record["pruned"] = None
        record["sha256"] = sha256_file(pruned)
        write_archive(staging / archive, {name: Member(pruned.read_bytes(), True)}, mtime)
    return record


def build_wheel_parts(
    project: Project,
    group: str,
    *,
    out: Path | None = None,
    wheel_list: Path = DEFAULT_WHEEL_LIST,
    python_version: str = DEFAULT_PYTHON,
    part_bytes: int | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Split the wheels of one ``device-wheels.toml`` group into parts for several calls.

    Some packages do not fit one device call (FlashInfer and the CUTLASS DSL
    it imports are about 170 MB). This writes ``out`` (default
    ``<repo>/.bundle-wheels/<group>``, ignored by git): the group's wheels as
    one uncompressed tar cut into ``part-NN`` files of at most ``part_bytes``
    (default: what a call has left beside today's working tree, whole MiB, less
    :data:`PART_MARGIN_BYTES`), and ``parts.json`` with the sha256 of every
    wheel, of the tar and of each part. Each part travels in its own device
    call (copied into one folder on a warm host); ``device_run.py --wheel-parts
    FOLDER`` joins and checks them and installs the wheels beside the bundle's.

    Returns:
        The folder and the manifest written to its ``parts.json``.
    """
    pins = [pin for pin in read_wheel_list(wheel_list) if pin.group == group]
    if not pins:
        groups = sorted({p.group for p in read_wheel_list(wheel_list) if p.group})
        raise HarnessError(
            f"{wheel_list} has no wheel group {group!r}; its groups: {', '.join(groups) or 'none'}"
        )
    if part_bytes is None:
        room = CALL_BYTES - travelling_tree_bytes(project.root) - PART_MARGIN_BYTES
        part_bytes = room // MiB * MiB
    if part_bytes < MiB:
        raise HarnessError(
            f"a part of {part_bytes} bytes is too small: give at least 1 MiB (a call "
            f"carries {CALL_BYTES // MiB} MiB, the working tree included)"
        )
    out = out or project.root / ".bundle-wheels" / group
    if out.exists() and any(out.iterdir()) and not (out / PARTS_MANIFEST).exists():
        raise HarnessError(f"{out} holds files that are not wheel parts; choose another --out")
    wheels = fetch_wheels(project, pins, python_version)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tar_path = out / WHEELS_TAR
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for wheel in sorted(wheels, key=lambda w: w.name):
            info = tar.gettarinfo(str(wheel), arcname=wheel.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = _ARCHIVE_MODE_FILE
            with wheel.open("rb") as fh:
                tar.addfile(info, fh)
    parts = []
    with tar_path.open("rb") as fh:
        for number, block in enumerate(iter(lambda: fh.read(part_bytes), b""), 1):
            part = out / f"part-{number:02d}"
            part.write_bytes(block)
            parts.append({"name": part.name, "bytes": len(block), "sha256": sha256_file(part)})
    manifest: dict[str, Any] = {
        "group": group,
        "python": python_version,
        "wheels": [
            {"name": w.name, "bytes": w.stat().st_size, "sha256": sha256_file(w)}
            for w in sorted(wheels, key=lambda w: w.name)
        ],
        "tar_bytes": tar_path.stat().st_size,
        "tar_sha256": sha256_file(tar_path),
        "parts": parts,
    }
    tar_path.unlink()
    (out / PARTS_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out, manifest


# --- carrying a bundle to the GPU host ---------------------------------------------------------

#: What one device call is planned to carry: the working tree that travels plus the paths in
#: ``carry``. The device allows 64 MiB by its own count, which came out higher than
#: :func:`travelling_tree_bytes` plus the carried files: a call of 63.3 MiB by this count was
#: refused as over the limit (2026-12-06). Plans keep 2 MiB below it.
CALL_BYTES = 62 * MiB
#: Most paths one call's ``carry`` may name.
CALL_PATHS = 8
#: Where bundle entries carried by earlier calls wait on the GPU host (kept while it is warm).
STAGED_DIR = "/tmp/bundle-staged"


@dataclasses.dataclass(frozen=True)
class CarryPlan:
    """How a bundle reaches the GPU host in device calls of at most :data:`CALL_BYTES`.

    Each call also carries the working tree (``tree_bytes``). When the tree and
    the bundle fit one call, ``staged`` is empty and ``final`` is the bundle
    folder. Otherwise each entry of ``staged`` is an earlier call that copies
    some bundle entries to :data:`STAGED_DIR` (the first one empties it), and
    ``final`` names the entries the last call carries itself; the calls must
    follow each other while the host is still warm (it is handed back, ``/tmp``
    with it, when idle).
    """

    bundle: str
    tree_bytes: int
    bundle_bytes: int
    staged: tuple[tuple[str, ...], ...]
    final: tuple[str, ...]
    call_bytes: int = CALL_BYTES

    def stage_command(self, call: int) -> str:
        """The command of earlier call ``call`` (0-based)."""
        paths = " ".join(shlex.quote(p) for p in self.staged[call])
        fresh = f"rm -rf {STAGED_DIR} && " if call == 0 else ""
        return f"{fresh}mkdir -p {STAGED_DIR} && cp -r {paths} {STAGED_DIR}/"

    @property
    def final_prefix(self) -> str:
        """What the last call's command begins with, before ``device_run.py``:
        the staged entries of this plan (and nothing else) back into the bundle."""
        if not self.staged:
            return ""
        names = sorted(PurePosixPath(p).name for call in self.staged for p in call)
        paths = " ".join(shlex.quote(f"{STAGED_DIR}/{name}") for name in names)
        return f"cp -r {paths} {shlex.quote(self.bundle)}/ && "

    def describe(self) -> str:
        """The plan as instructions, one line per call."""
        total = self.tree_bytes + self.bundle_bytes
        head = (
            f"working tree {self.tree_bytes / MiB:.1f} MiB + bundle "
            f"{self.bundle_bytes / MiB:.1f} MiB = {total / MiB:.1f} MiB"
        )
        if not self.staged:
            return f"{head}: one call, carry [{self.bundle!r}]"
        lines = [
            f"{head}, over one call's {self.call_bytes / MiB:.0f} MiB: {len(self.staged) + 1} "
            "calls in a row on one warm machine"
        ]
        for i, paths in enumerate(self.staged):
            carry = ", ".join(repr(p) for p in paths)
            lines.append(f"  call {i + 1}: carry [{carry}]; command: {self.stage_command(i)}")
        carry = ", ".join(repr(p) for p in self.final)
        lines.append(
            f"  call {len(self.staged) + 1}: carry [{carry}]; command: "
            f"{self.final_prefix}python3 {self.bundle}/device_run.py ..."
        )
        return "\n".join(lines)


def _tree_bytes(paths: Iterable[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def travelling_tree_bytes(root: Path) -> int:
    """Bytes of what a device call sends of ``root``: tracked files, untracked
    files git does not ignore, and a ``shared/`` folder (which travels even when
    ignored); deleted files and links count as nothing."""
    listed = git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout
    names = set(filter(None, listed.split("\0")))
    shared = root / "shared"
    extra = shared.rglob("*") if shared.is_dir() else iter(())
    return _tree_bytes(root / name for name in names) + _tree_bytes(
        p for p in extra if p.relative_to(root).as_posix() not in names
    )


def _entry_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return _tree_bytes(path.rglob("*"))


#: Bundle entries that travel with the last call, which runs them.
_LAST_CALL = ("MANIFEST.txt", "device_run.py", "provenance.json")


def plan_carry(
    root: Path,
    bundle_dir: Path,
    *,
    call_bytes: int = CALL_BYTES,
    call_paths: int = CALL_PATHS,
    tree_bytes: int | None = None,
) -> CarryPlan:
    """Plan the device calls that bring ``bundle_dir`` (inside ``root``) to the host.

    The largest bundle entries are carried ahead until the rest fits the last
    call with the tree by bytes, then the smallest until it fits by paths; the
    entries ahead are packed first fit, largest first, each earlier call as full
    as one call allows (by bytes and by paths).

    Raises:
        HarnessError: ``bundle_dir`` is not inside ``root``; the tree leaves no
            room for some bundle entry; or no plan keeps the last call within
            ``call_bytes`` and ``call_paths``.

    """
    root = root.resolve()
    bundle_dir = (root / bundle_dir).resolve()
    try:
        rel = bundle_dir.relative_to(root).as_posix()
    except ValueError:
        raise HarnessError(
            f"{bundle_dir} is not inside {root}: a device call cannot carry it"
        ) from None
    tree = travelling_tree_bytes(root) if tree_bytes is None else tree_bytes
    entries = sorted(
        ((f"{rel}/{p.name}", _entry_bytes(p)) for p in bundle_dir.iterdir()),
        key=lambda e: (-e[1], e[0]),
    )
    total = sum(size for _, size in entries)
    if tree + total <= call_bytes:
        return CarryPlan(rel, tree, total, (), (rel,), call_bytes)
    room = call_bytes - tree
    last = {f"{rel}/{name}" for name in _LAST_CALL}
    movable = [e for e in entries if e[0] not in last]
    too_big = [name for name, size in movable if size > room]
    if room <= 0 or too_big:
        raise HarnessError(
            f"the working tree ({tree / MiB:.1f} MiB) leaves {max(room, 0) / MiB:.1f} MiB of a "
            f"call's {call_bytes / MiB:.0f} MiB, too little for "
            f"{', '.join(too_big) or 'any bundle entry'}; commit fewer large files or build "
            "the bundle with fewer tests, kernels or wheels"
        )
    remaining, count = total, len(entries)
    ahead: list[tuple[str, int]] = []
    rest = list(movable)  # largest first
    while rest and (remaining > room or count > call_paths):
        # The largest entries ahead until the bytes fit; then, for the paths, the
        # smallest, which fit into calls already planned.
        entry = rest.pop(0 if remaining > room else -1)
        ahead.append(entry)
        remaining -= entry[1]
        count -= 1
    ahead.sort(key=lambda e: (-e[1], e[0]))
    if remaining > room or count > call_paths:
        raise HarnessError(
            f"no plan keeps the last call within {call_bytes / MiB:.0f} MiB and "
            f"{call_paths} paths: {', '.join(sorted(last))} alone are "
            f"{(total - sum(s for _, s in movable)) / MiB:.1f} MiB"
        )
    calls: list[list[tuple[str, int]]] = []
    for entry in ahead:  # first fit, largest first
        for call in calls:
            if len(call) < call_paths and sum(s for _, s in call) + entry[1] <= room:
                call.append(entry)
                break
        else:
            calls.append([entry])
    moved = {name for name, _ in ahead}
    final = tuple(sorted(name for name, _ in entries if name not in moved))
    staged = tuple(tuple(sorted(name for name, _ in call)) for call in calls)
    return CarryPlan(rel, tree, total, staged, final, call_bytes)
