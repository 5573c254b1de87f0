"""Standalone build of a Marlin MoE op subset, for kernel A/B replays and tests.

A full vLLM build takes hours and compiles ~1200 Marlin MoE instantiations for
every architecture. Kernel changes of the series (the 64-bit per-expert weight
offsets) only need the Marlin MoE GEMM for a few weight formats and the GPTQ
repack that prepares NVFP4 weights. :func:`build_kernels` compiles exactly that
from one git revision of the materialized vLLM tree:

1. ``git archive <rev> csrc`` into a fresh build folder (the tree's work copy
   and other worktrees are never touched, so any branch, tag or commit works:
   ``series`` for the patched tree, the base tag for stock);
2. vLLM's own kernel generator, restricted to the requested weight formats
   and activation types (:mod:`harness.marlin_generate`; default
   :data:`DEFAULT_FORMATS`: NVFP4 with bf16 and fp16, FP8, GPTQ int4 and AWQ
   int4 with fp16, MXFP4 and MXFP8 with bf16: the formats and activation
   types of vLLM's own Marlin MoE tests on sm_90 except GPTQ int8 and the
   8-bit activations of releases that have them);
3. the translation units compiled with ``nvcc``/``g++`` for one GPU
   architecture, at most ``jobs`` at a time: one per generated kernel file,
   ``ops.cu``, ``gptq_marlin_repack.cu`` and the op schemas in
   ``harness/kernels_binding.cpp``, in the form of the tree's release
   (:func:`schema_defines`: 0.33.0's ops take 8-bit activation arguments that
   0.34.0 removed);
4. one link into ``lib<namespace>.so`` plus a ``lib<namespace>.json`` manifest.

The ops register as ``torch.ops.<namespace>.moe_wna16_marlin_gemm`` and
``torch.ops.<namespace>.gptq_marlin_repack``. Host symbols are hidden and the
kernel namespace is renamed per build, so a stock and a patched library load
side by side in one process. The library targets the torch stable ABI of
torch 2.11 (``TORCH_TARGET_VERSION``), so headers of a newer torch build a
library that loads on torch >= 2.11. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from harness.project import HarnessError, Project, git, nvidia_smi, progress, run, sha256_file
from harness.venv import venv_python

HERE = Path(__file__).resolve().parent
BINDING_SOURCE = HERE / "kernels_binding.cpp"
GENERATOR_WRAPPER = HERE / "marlin_generate.py"

#: Stable-ABI target: torch 2.11.0, encoded as torch's version macro expects.
TORCH_TARGET_VERSION = "0x020B000000000000ULL"

#: Paths inside the vLLM tree.
MOE_DIR = "csrc/moe/marlin_moe_wna16"
GENERATOR = "csrc/quantization/marlin/generate_kernels.py"
REPACK_SOURCE = "csrc/quantization/marlin/gptq_marlin_repack.cu"
KERNEL_GLOB = "sm*_kernel_*.cu"
OPS_SOURCE = f"{MOE_DIR}/ops.cu"

#: Weight formats built by default (:mod:`harness.marlin_generate` syntax).
DEFAULT_FORMATS = (
    "nvfp4:bf16,fp16",
    "fp8:fp16",
    "gptq4:fp16",
    "awq4:fp16",
    "mxfp4:bf16",
    "mxfp8:bf16",
)

#: vLLM's own extension namespaces: a standalone library must not reuse them,
#: or it would clash with an installed vLLM in the same process.
RESERVED_NAMESPACES = frozenset({"_C", "_moe_C", "_rocm_C", "_C_cache_ops", "_C_utils"})

_NAMESPACE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_ARCH_RE = re.compile(r"(?:sm_|compute_)?(\d+)\.?(\d)([af]?)")


# --------------------------------------------------------------------------- inputs


def check_namespace(namespace: str) -> str:
    """Return ``namespace`` if it can be a torch op namespace of its own."""
    if not _NAMESPACE_RE.fullmatch(namespace):
        raise HarnessError(
            f"op namespace {namespace!r} must be a C identifier (at most 64 "
            f"characters), e.g. marlin_series"
        )
    if namespace in RESERVED_NAMESPACES:
        raise HarnessError(f"op namespace {namespace!r} is vLLM's own; pick another")
    return namespace


def normalize_arch(value: str) -> str:
    """Turn ``9.0``, ``90``, ``sm_90`` or ``90a`` into nvcc's digits form (``90``/``90a``)."""
    match = _ARCH_RE.fullmatch(value.strip().lower())
    if not match:
        raise HarnessError(
            f"GPU architecture {value!r} not understood; give it like 9.0, 90 or sm_90"
        )
    major, minor, suffix = match.groups()
    arch = f"{int(major)}{minor}{suffix}"
    if int(major) < 8:
        raise HarnessError(f"Marlin MoE NVFP4 needs compute capability >= 8.0, not {value}")
    return arch


def parse_compute_caps(text: str) -> str:
    """Architecture from ``nvidia-smi --query-gpu=compute_cap --format=csv,noheader``.

    One line per GPU; all GPUs must agree, because the build targets exactly one
    architecture.
    """
    caps = {line.strip() for line in text.splitlines() if line.strip()}
    if not caps:
        raise HarnessError("nvidia-smi reported no GPU; pass --arch")
    if len(caps) > 1:
        raise HarnessError(
            f"GPUs of different compute capabilities ({', '.join(sorted(caps))}); "
            f"pass --arch to choose one"
        )
    return normalize_arch(caps.pop())


def detect_arch(
    query: Callable[[], str | None] | None = None,
) -> str | None:
    """The local GPU's architecture, or ``None`` when there is no usable nvidia-smi."""
    text = (query or _query_nvidia_smi)()
    return None if text is None else parse_compute_caps(text)


def _query_nvidia_smi() -> str | None:
    rows = nvidia_smi("compute_cap")
    return None if rows is None else "\n".join(row[0] for row in rows)


def resolve_arch(arch: str | None, query: Callable[[], str | None] | None = None) -> str:
    """``arch`` normalized, else the detected one; refuse when neither is known."""
    if arch:
        return normalize_arch(arch)
    detected = detect_arch(query)
    if detected is None:
        raise HarnessError(
            "no GPU architecture given and nvidia-smi cannot report one; "
            "pass --arch (e.g. --arch 9.0 for H100/H200)"
        )
    return detected


def gencode(arch: str) -> list[str]:
    """nvcc flags for SASS of exactly ``arch`` (no PTX, so no JIT at load time)."""
    return ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]


def generator_arch(arch: str) -> str:
    """The ``major.minor`` form vLLM's generator script expects (``90a`` -> ``9.0``)."""
    digits = arch.rstrip("af")
    return f"{digits[:-1]}.{digits[-1]}"


# --------------------------------------------------------------------------- toolchain


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """Compilers and the torch installation whose headers and libraries are used."""

    nvcc: Path
    cxx: Path
    python: Path
    torch_dir: Path
    torch_version: str
    cuda_include: Path | None  # nvidia/cu13/include beside torch: cublas_v2.h etc.
    nvcc_version: str

    def describe(self) -> dict[str, str | None]:
        return {
            "nvcc": str(self.nvcc),
            "nvcc_version": self.nvcc_version,
            "cxx": str(self.cxx),
            "python": str(self.python),
            "torch_dir": str(self.torch_dir),
            "torch_version": self.torch_version,
            "cuda_include": str(self.cuda_include) if self.cuda_include else None,
        }


_TORCH_PROBE = """
import importlib.util, json, os
spec = importlib.util.find_spec("torch")
if spec is None or not spec.submodule_search_locations:
    print(json.dumps({}))
    raise SystemExit(0)
torch_dir = list(spec.submodule_search_locations)[0]
version = ""
vfile = os.path.join(torch_dir, "version.py")
if os.path.exists(vfile):
    scope = {}
    exec(open(vfile).read(), scope)
    version = str(scope.get("__version__", ""))
inc = os.path.join(os.path.dirname(torch_dir), "nvidia", "cu13", "include")
print(json.dumps({"torch_dir": torch_dir, "version": version,
                  "cuda_include": inc if os.path.isdir(inc) else None}))
"""


def probe_torch(python: Path) -> dict[str, str | None]:
    """Locate torch for ``python`` without importing it (no GPU driver needed)."""
    proc = subprocess.run(
        [str(python), "-c", _TORCH_PROBE], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise HarnessError(f"{python} cannot run: {proc.stderr.strip()}")
    info: dict[str, str | None] = json.loads(proc.stdout or "{}")
    if not info.get("torch_dir"):
        raise HarnessError(
            f"{python} has no torch; pass --python with a Python whose torch is >= 2.11 "
            f"(CUDA build)"
        )
    return info


def find_toolchain(
    python: Path | None = None,
    nvcc: Path | None = None,
    cxx: Path | None = None,
    probe: Callable[[Path], dict[str, str | None]] = probe_torch,
) -> Toolchain:
    """Check that nvcc, a host compiler and torch's stable-ABI headers are present."""
    nvcc_path = nvcc or _which("nvcc", os.environ.get("CUDA_HOME"))
    if nvcc_path is None or not nvcc_path.exists():
        raise HarnessError(
            "nvcc not found: put the CUDA toolkit's bin on PATH, set CUDA_HOME or pass --nvcc"
        )
    cxx_path = cxx or _which(os.environ.get("CXX", "g++"), None)
    if cxx_path is None:
        raise HarnessError("no C++ compiler (g++) found; set CXX")
    py = python or Path(sys.executable)
    info = probe(py)
    torch_dir = Path(str(info["torch_dir"]))
    header = torch_dir / "include" / "torch" / "csrc" / "stable" / "library.h"
    if not header.exists():
        raise HarnessError(
            f"torch at {torch_dir} has no stable-ABI headers ({header.name} missing); "
            f"it needs torch >= 2.11 installed with its include/ folder"
        )
    lib = torch_dir / "lib"
    if not any(lib.glob("libtorch_cuda.*")):
        raise HarnessError(f"torch at {torch_dir} is not a CUDA build (no libtorch_cuda)")
    inc = info.get("cuda_include")
    return Toolchain(
        nvcc=nvcc_path,
        cxx=cxx_path,
        python=py,
        torch_dir=torch_dir,
        torch_version=str(info.get("version") or ""),
        cuda_include=Path(inc) if inc else None,
        nvcc_version=_nvcc_version(nvcc_path),
    )


def _which(name: str, home: str | None) -> Path | None:
    if home and (Path(home) / "bin" / name).exists():
        return Path(home) / "bin" / name
    found = shutil.which(name)
    return Path(found) if found else None


def _nvcc_version(nvcc: Path) -> str:
    proc = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"release (\S+), (V\S+)", proc.stdout)
    return f"{match.group(1).rstrip(',')} {match.group(2)}" if match else "unknown"


# --------------------------------------------------------------------------- commands


@dataclasses.dataclass(frozen=True)
class Step:
    """One compiler invocation of the build."""

    name: str
    argv: tuple[str, ...]
    output: Path


def toolkit_include(nvcc: Path) -> Path | None:
    """The include folder nvcc itself passes to its front ends (from ``--dryrun``)."""
    proc = subprocess.run(
        [str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    match = re.search(r'INCLUDES="-I([^"]+)"', proc.stdout + proc.stderr)
    return Path(match.group(1)).resolve() if match else None


def library_header_shim(cuda_include: Path, toolkit: Path | None, shim: Path) -> Path:
    """A folder linking the CUDA library headers (cuBLAS...) the toolkit lacks.

    ``torch_utils.h`` includes ``cublas_v2.h``, which a bare nvcc install may
    not have while torch's ``nvidia/cu13/include`` does. Adding that folder
    with ``-I`` would also shadow nvcc's own runtime headers with those of
    torch's CUDA release, whose host stubs need not match this nvcc (seen as
    "``__cudaLaunch`` was not declared"). So only the missing top-level
    entries are linked into ``shim``.
    """
    shim.mkdir(parents=True, exist_ok=True)
    have = {p.name for p in toolkit.iterdir()} if toolkit and toolkit.is_dir() else set()
    for entry in sorted(cuda_include.iterdir()):
        if entry.name not in have:
            (shim / entry.name).symlink_to(entry)
    return shim


def common_nvcc_flags(
    tc: Toolchain, src: Path, arch: str, extra_include: Path | None = None
) -> list[str]:
    """Flags shared by every CUDA translation unit (mirrors vLLM's CMake for Marlin MoE)."""
    flags = [
        "-std=c++20",
        "-O3",
        "-DNDEBUG",
        "-DUSE_CUDA",
        "-DENABLE_FP8",
        f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}",
        "--expt-relaxed-constexpr",
        # vLLM passes this for CUDA >= 12.8; without it the host stubs of the
        # hidden kernel templates do not link.
        "-static-global-template-stub=false",
        "-Xcompiler",
        "-fPIC",
        "-Xcompiler",
        "-fvisibility=hidden",
        f"-I{src / 'csrc'}",
        f"-I{tc.torch_dir / 'include'}",
    ]
    if extra_include is not None:
        flags.append(f"-I{extra_include}")
    return flags + gencode(arch)


def schema_defines(src: Path) -> list[str]:
    """``-D`` flags that give ``kernels_binding.cpp`` the op schemas of the tree.

    Read from the sources rather than a version: vLLM 0.33.0's
    ``moe_wna16_marlin_gemm`` takes ``a_scales`` (8-bit activations) and its
    ``gptq_marlin_repack`` takes ``is_a_8bit``; 0.34.0 removed both.
    """
    flags = []
    if re.search(r"\ba_scales\b", (src / OPS_SOURCE).read_text(errors="replace")):
        flags.append("-DHARNESS_GEMM_A_SCALES")
    if re.search(r"\bis_a_8bit\b", (src / REPACK_SOURCE).read_text(errors="replace")):
        flags.append("-DHARNESS_REPACK_IS_A_8BIT")
    return flags


def kernel_units(src: Path) -> list[Path]:
    """The generated kernel translation units of an exported tree, sorted by name."""
    return sorted((src / MOE_DIR).glob(KERNEL_GLOB))


def compile_steps(
    tc: Toolchain,
    src: Path,
    objdir: Path,
    namespace: str,
    arch: str,
    *,
    units: Sequence[Path] = (),
    ptxas_verbose: bool = False,
    extra_include: Path | None = None,
    binding_defines: Sequence[str] = (),
) -> list[Step]:
    """The compiler invocations; ``src`` is the exported tree (holding ``csrc``).

    One ``kernels-<file stem>`` step per kernel unit in ``units`` (the files
    the generator wrote, :func:`kernel_units`), then ``ops``, ``repack`` and
    ``binding`` (with ``binding_defines``, :func:`schema_defines`).
    """
    nvcc = [str(tc.nvcc), *common_nvcc_flags(tc, src, arch, extra_include)]
    moe_ns = [f"-DMARLIN_NAMESPACE_NAME=marlin_moe_wna16_{namespace}", f"-D_moe_C={namespace}"]
    moe = src / MOE_DIR
    kernel_extra = ["-Xptxas", "-v"] if ptxas_verbose else []
    steps = [
        Step(
            f"kernels-{unit.stem}",
            (
                *nvcc,
                *moe_ns,
                *kernel_extra,
                "-c",
                str(unit),
                "-o",
                str(objdir / f"{unit.stem}.o"),
            ),
            objdir / f"{unit.stem}.o",
        )
        for unit in units
    ]
    steps += [
        Step(
            "ops",
            (*nvcc, *moe_ns, "-c", str(moe / "ops.cu"), "-o", str(objdir / "ops.o")),
            objdir / "ops.o",
        ),
        # The repack TU hard-codes namespace marlin::, so only its op namespace moves.
        Step(
            "repack",
            (
                *nvcc,
                f"-D_C={namespace}",
                "-c",
                str(src / REPACK_SOURCE),
                "-o",
                str(objdir / "repack.o"),
            ),
            objdir / "repack.o",
        ),
        Step(
            "binding",
            (
                str(tc.cxx),
                "-std=c++20",
                "-O2",
                "-fPIC",
                "-fvisibility=hidden",
                "-DUSE_CUDA",
                f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}",
                f"-DHARNESS_OPS_NAMESPACE={namespace}",
                *binding_defines,
                f"-I{tc.torch_dir / 'include'}",
                "-c",
                str(BINDING_SOURCE),
                "-o",
                str(objdir / "binding.o"),
            ),
            objdir / "binding.o",
        ),
    ]
    return steps


def link_step(tc: Toolchain, objects: Sequence[Path], library: Path, arch: str) -> Step:
    """Link the objects against torch's libraries into one loadable library."""
    lib = tc.torch_dir / "lib"
    argv = (
        str(tc.nvcc),
        "-shared",
        *gencode(arch),
        "-o",
        str(library),
        *map(str, objects),
        f"-L{lib}",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_cuda",
        "-lcudart",
    )
    return Step("link", argv, library)


def run_parallel(steps: Sequence[Step], logdir: Path, jobs: int | None = None) -> None:
    """Run ``steps``, at most ``jobs`` at a time (default: all at once), each logging
    to ``<logdir>/<name>.log``; wait for every one, then report the failures."""
    limit = max(1, jobs or len(steps) or 1)
    pending = list(steps)
    running: list[tuple[Step, subprocess.Popen[bytes], Path]] = []
    failed = []
    while pending or running:
        while pending and len(running) < limit:
            step = pending.pop(0)
            log = logdir / f"{step.name}.log"
            progress(f"compiling {step.name} (log: {log})")
            with log.open("wb") as fh:
                proc = subprocess.Popen(step.argv, stdout=fh, stderr=subprocess.STDOUT)
            running.append((step, proc, log))
        step, proc, log = running.pop(0)
        if proc.wait() != 0 or not step.output.exists():
            failed.append((step, log))
    if failed:
        step, log = failed[0]
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        names = ", ".join(s.name for s, _ in failed)
        raise HarnessError(f"compile failed: {names}. Last lines of {log}:\n{tail}")


# --------------------------------------------------------------------------- build


def export_sources(tree: Path, rev: str, dest: Path) -> str:
    """Extract ``csrc`` of ``rev`` into ``dest``; return the full commit id."""
    commit = git(tree, "rev-parse", "--verify", f"{rev}^{{commit}}").stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "csrc.tar"
        git(tree, "archive", "--format=tar", "-o", str(archive), commit, "csrc")
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    return commit


def generate(tc: Toolchain, src: Path, arch: str, formats: Sequence[str]) -> list[Path]:
    """Write the kernel TUs of ``formats`` and ``kernel_selector.h`` beside ``ops.cu``.

    Returns the generated kernel units (:func:`kernel_units`).
    """
    moe = src / MOE_DIR
    run([tc.python, GENERATOR_WRAPPER, src / GENERATOR, generator_arch(arch), moe, *formats])
    units = kernel_units(src)
    if not units or not (moe / "kernel_selector.h").exists():
        raise HarnessError(f"the kernel generator wrote no {KERNEL_GLOB} into {moe}")
    return units


def count_instantiations(units: Sequence[Path]) -> dict[str, int]:
    """Explicit ``Marlin<...>`` instantiations per generated file name."""
    return {unit.name: unit.read_text().count("template __global__ void Marlin<") for unit in units}


def combine_logs(build: Path, steps: Sequence[Step]) -> Path:
    """Concatenate the kernel steps' logs into ``<build>/kernels.log`` (ptxas reports)."""
    out = build / "kernels.log"
    with out.open("w") as fh:
        for step in steps:
            if step.name.startswith("kernels-"):
                fh.write((build / f"{step.name}.log").read_text(errors="replace"))
    return out


def build_kernels(
    project: Project,
    *,
    rev: str,
    namespace: str,
    out_dir: Path | None = None,
    arch: str | None = None,
    python: Path | None = None,
    nvcc: Path | None = None,
    ptxas_verbose: bool = False,
    formats: Sequence[str] = DEFAULT_FORMATS,
    jobs: int | None = None,
) -> Path:
    """Build ``lib<namespace>.so`` from revision ``rev`` of the materialized tree.

    Args:
        project: The harness project; its ``tree`` is the vLLM git repository.
        rev: Any revision of that repository, e.g. ``series`` or ``v0.33.0``.
        namespace: Torch op namespace of the library (``torch.ops.<namespace>``).
        out_dir: Where ``lib<namespace>.so`` and its ``.json`` manifest go
            (default ``<work>/kernels``). The build folder is
            ``<out_dir>/build-<namespace>``; it is recreated on every build and
            keeps the sources and compiler logs for inspection.
        arch: GPU architecture (``9.0``, ``90``, ``sm_90``...); detected with
            nvidia-smi when omitted.
        python: Python whose torch provides headers and libraries (default:
            the harness venv's, which has the pinned torch, when it exists;
            else the running one). Its torch must be a CUDA build, >= 2.11.
        nvcc: nvcc to use (default: ``$CUDA_HOME/bin/nvcc`` or PATH).
        ptxas_verbose: Pass ``-Xptxas -v`` to the kernel TUs; the register and
            spill report of every TU lands in ``build-<namespace>/kernels.log``.
        formats: Weight formats to build (:mod:`harness.marlin_generate`
            syntax, e.g. ``nvfp4:bf16``); default :data:`DEFAULT_FORMATS`.
        jobs: Compiler processes at a time (default: the CPU count).

    Returns:
        Path of the built library.

    Raises:
        HarnessError: bad namespace or architecture, missing toolchain or torch
            headers, unknown revision, or a failed compile.
    """
    check_namespace(namespace)
    target = resolve_arch(arch)
    tree = project.tree
    if not (tree / ".git").exists():
        raise HarnessError(f"no vLLM tree at {tree}; run `python -m harness base` first")
    if python is None and venv_python(project).exists():
        python = venv_python(project)
    tc = find_toolchain(python=python, nvcc=nvcc)
    out = (out_dir or project.work / "kernels").resolve()
    build = out / f"build-{namespace}"
    if build.exists():
        shutil.rmtree(build)
    src = build / "src"
    objdir = build / "obj"
    src.mkdir(parents=True)
    objdir.mkdir()

    started = time.monotonic()
    commit = export_sources(tree, rev, src)
    progress(f"building lib{namespace}.so from {rev} ({commit[:12]}) for sm_{target}")
    units = generate(tc, src, target, formats)
    defines = schema_defines(src)
    shim = None
    if tc.cuda_include is not None:
        shim = library_header_shim(tc.cuda_include, toolkit_include(tc.nvcc), build / "include")
    steps = compile_steps(
        tc,
        src,
        objdir,
        namespace,
        target,
        units=units,
        ptxas_verbose=ptxas_verbose,
        extra_include=shim,
        binding_defines=defines,
    )
    jobs = jobs or os.cpu_count() or 1
    run_parallel(steps, build, jobs)
    combine_logs(build, steps)
    library = out / f"lib{namespace}.so"
    link = link_step(tc, [s.output for s in steps], library, target)
    run_parallel([link], build)
    seconds = round(time.monotonic() - started, 1)

    manifest = {
        "library": library.name,
        "sha256": sha256_file(library),
        "namespace": namespace,
        "ops": [f"{namespace}::moe_wna16_marlin_gemm", f"{namespace}::gptq_marlin_repack"],
        "schema_defines": defines,
        "rev": rev,
        "commit": commit,
        "formats": list(formats),
        "instantiations": count_instantiations(units),
        "library_bytes": library.stat().st_size,
        "jobs": jobs,
        "arch": f"sm_{target}",
        "torch_target_version": TORCH_TARGET_VERSION,
        "toolchain": tc.describe(),
        "commands": [list(s.argv) for s in (*steps, link)],
        "build_seconds": seconds,
    }
    (out / f"lib{namespace}.json").write_text(json.dumps(manifest, indent=2) + "\n")
    progress(f"built {library} in {seconds} s")
    return library


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m harness kernels``."""
    parser.add_argument(
        "--rev",
        default="series",
        help="revision of the vLLM tree to build (default: series; `base`: the pinned "
        "release's tag, stock)",
    )
    parser.add_argument(
        "--namespace", required=True, help="torch op namespace, e.g. marlin_series or marlin_base"
    )
    parser.add_argument("--arch", help="GPU architecture such as 9.0 (default: nvidia-smi)")
    parser.add_argument("--out", type=Path, help="output folder (default: <work>/kernels)")
    parser.add_argument(
        "--python", type=Path, help="Python whose torch (>= 2.11, CUDA) supplies headers"
    )
    parser.add_argument("--nvcc", type=Path, help="nvcc to use (default: PATH)")
    parser.add_argument(
        "--ptxas-verbose",
        action="store_true",
        help="log ptxas register/spill usage of every kernel",
    )
    parser.add_argument(
        "--format",
        dest="formats",
        action="append",
        metavar="NAME[:ACT,...]",
        help=(
            "weight format to build, repeatable: nvfp4, mxfp4, fp8, mxfp8, gptq4, awq4, "
            "gptq8, each optionally with activations bf16/fp16 (e.g. gptq4:fp16); "
            f"default: {' '.join(DEFAULT_FORMATS)}"
        ),
    )
    parser.add_argument(
        "--jobs", type=int, help="compiler processes at a time (default: the CPU count)"
    )


def command(project: Project, args: argparse.Namespace) -> int:
    """Handler of ``python -m harness kernels``; prints the library path."""
    library = build_kernels(
        project,
        rev=project.pin.release.tag if args.rev == "base" else args.rev,
        namespace=args.namespace,
        out_dir=args.out,
        arch=args.arch,
        python=args.python,
        nvcc=args.nvcc,
        ptxas_verbose=args.ptxas_verbose,
        formats=tuple(args.formats or DEFAULT_FORMATS),
        jobs=args.jobs,
    )
    print(library)
    return 0
