"""Stage 3: build a vLLM wheel from the patched tree.

The default is vLLM's python-only build: ``VLLM_USE_PRECOMPILED=1`` with the
pinned, hash-checked release wheel as ``VLLM_PRECOMPILED_WHEEL_LOCATION``. In
that mode vLLM copies the release's compiled libraries and skips its own check
for changed compiled sources, so a series that touches them would silently
ship the release's kernels. The harness therefore refuses that case unless the
caller says ``stock_kernels=True`` (the compiled changes are then built and
tested separately by ``python -m harness kernels``), and ``full=True`` runs the
normal CUDA build on hosts with CUDA and network access.

The wheel is built from a ``git archive`` snapshot of ``series``, never from
the work tree itself: the build rewrites tracked files (``vllm/_version.py``,
the egg-info), which would dirty the tree the series lives in.

The wheel keeps the name the build gives it: pip and uv read its version and
Python tag from it (``...-cp311-cp311-linux_x86_64.whl``: CPython 3.11 only).
``python -m harness build`` prints its absolute path last (``wheel: PATH``) and
writes it, one line, to ``<work>/dist/LATEST`` (:data:`LATEST`), where install
commands read it (docs/serving.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path

from harness import patches, series
from harness.base import fetch
from harness.project import HarnessError, Project, git, progress, run, sha256_file
from harness.venv import ensure_venv, uv_env

# Paths whose changes the python-only build cannot carry into the wheel.
COMPILED_PATHS = ("csrc/", "cmake/", "CMakeLists.txt", "setup.py", "pyproject.toml")

#: The file in ``<work>/dist`` that holds the built wheel's absolute path.
LATEST = "LATEST"


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """What was built, from what: the provenance of one wheel."""

    wheel: str
    wheel_sha256: str
    mode: str  # "python-only" or "full"
    stock_kernels: tuple[str, ...]  # compiled paths the series changes but the wheel lacks
    series_hash: str
    tree_commit: str

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> BuildInfo:
        if not path.exists():
            raise HarnessError("no wheel has been built yet: run `python -m harness build`")
        data = json.loads(path.read_text())
        data["stock_kernels"] = tuple(data["stock_kernels"])
        return cls(**data)


def compiled_changes(
    tree: Path, base: str, revision: str = "HEAD", paths: tuple[str, ...] = COMPILED_PATHS
) -> list[str]:
    """Files under ``paths`` (folders end in ``/``) that ``base..revision`` changes."""
    names = git(tree, "diff", "--name-only", f"{base}..{revision}").stdout.split()
    return [n for n in names if any(n.startswith(p) if p.endswith("/") else n == p for p in paths)]


def build_requirements(tree: Path) -> list[str]:
    """vLLM's own ``[build-system].requires`` (it pins torch)."""
    data = tomllib.loads((tree / "pyproject.toml").read_text())
    return [r.replace(" ", "") for r in data["build-system"]["requires"]]


def check_torch_pin(requirements: list[str], torch: str, version: str) -> None:
    """Refuse a tree whose build requirements pin another torch than ``patches/base.toml``.

    The pin file is what selects each release's torch (and so its venv); a
    release whose sdist says otherwise has a wrong pin, and building would
    quietly use a torch the pin does not name.
    """
    pinned = [r.removeprefix("torch==") for r in requirements if r.startswith("torch==")]
    if pinned and pinned != [torch]:
        raise HarnessError(
            f"vLLM {version}'s pyproject.toml builds with torch {', '.join(pinned)}, but "
            f"patches/base.toml pins torch {torch} for it; fix the pin"
        )


def snapshot(tree: Path, dest: Path, paths: tuple[str, ...] = ()) -> None:
    """Export ``HEAD`` of ``tree`` (or only ``paths`` of it) into a fresh ``dest``."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.Popen(
        ["git", "-C", str(tree), "archive", "--format=tar", "HEAD", *paths],
        stdout=subprocess.PIPE,
    )
    # -m: file times are "now", not the commit date (which may lie in the future)
    subprocess.run(["tar", "-x", "-m", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise HarnessError(f"git archive failed in {tree}")


def build(project: Project, *, full: bool = False, stock_kernels: bool = False) -> BuildInfo:
    """``python -m harness build``: build the wheel of the applied series."""
    tree, base = series.prepare(project)
    series.ensure_clean(tree)
    series.ensure_exported(project, tree, base)
    changed = compiled_changes(tree, base)
    if changed and not full and not stock_kernels:
        raise HarnessError(
            "the series changes compiled sources, which a python-only build would "
            "silently replace with the release's binaries:\n  "
            + "\n  ".join(changed)
            + "\nBuild those kernels with `python -m harness kernels` (tests load them "
            "from there) and pass --stock-kernels to build the Python part anyway, or "
            "use --full on a host with CUDA and network access."
        )
    pin = project.pin
    requirements = build_requirements(tree)
    check_torch_pin(requirements, pin.torch, pin.release.version)
    python = ensure_venv(project, requirements)
    src = project.work / "build" / "src"
    progress(f"snapshot of series ({git(tree, 'rev-parse', '--short', 'HEAD').stdout.strip()})")
    snapshot(tree, src)
    digest = patches.series_hash(project)
    if alone := series.applied_alone(project, tree, base):
        digest += "." + ".".join(f"alone{name[:4]}" for name in alone)
    env = {
        **uv_env(),
        # A local version label ties the wheel to the series it was built from.
        "SETUPTOOLS_SCM_PRETEND_VERSION": f"{pin.release.version}+series.{digest}",
        "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 2)),
    }
    if not full:
        wheel = fetch(project, pin.wheel, pin.wheel_sha256)
        env |= {"VLLM_USE_PRECOMPILED": "1", "VLLM_PRECOMPILED_WHEEL_LOCATION": str(wheel)}
    dist = project.work / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    log = dist / "build.log"
    progress(
        f"building the wheel ({'python-only: about a minute' if not full else 'full CUDA build'});"
        f" log: {log}"
    )
    run(
        [
            "uv",
            "build",
            "--wheel",
            "--no-build-isolation",
            "--python",
            str(python),
            "--out-dir",
            str(dist),
            str(src),
        ],
        env=env,
        log=log,
    )
    (built,) = (wheel.resolve() for wheel in dist.glob("vllm-*.whl"))
    info = BuildInfo(
        wheel=str(built),
        wheel_sha256=sha256_file(built),
        mode="full" if full else "python-only",
        stock_kernels=tuple(changed if not full else ()),
        series_hash=digest,
        tree_commit=git(tree, "rev-parse", "HEAD").stdout.strip(),
    )
    info.write(dist / "build.json")
    (dist / LATEST).write_text(f"{built}\n")
    progress(f"built {built.name}")
    return info


def built(project: Project) -> BuildInfo:
    """The last build's record (``.work/dist/build.json``)."""
    return BuildInfo.read(project.work / "dist" / "build.json")
