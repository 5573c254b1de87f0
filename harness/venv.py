"""The harness venv: one uv-made venv under the work area, for building, testing and lint.

Everything that installs into it goes through here: the build requirements,
the test requirements, lint's pinned tools, and the built wheel (:func:`install`,
which installs it into a fresh venv too, as docs/serving.md tells users). The test
requirements are the versions of harness/data/tools.lock (harness.toolpins);
only they are pinned, not what the lock holds beside them: the venv's other
packages are the wheel's dependencies, which vLLM's own pins decide.
"""

from __future__ import annotations

from pathlib import Path

from harness import toolpins
from harness.project import Project, progress, run

# What vLLM's tests/conftest.py imports beyond vLLM's own dependencies, and
# pytest-xdist, which runs the CPU tier on every CPU (harness.test).
TEST_REQUIREMENTS = ["pytest", "pytest-asyncio", "tblib", "pytest-xdist"]

# Left alone, the resolver satisfies flashinfer-python's `cuda-python>=12.0`
# with 12.6, whose files overwrite cuda-bindings 13 that torch and the CUTLASS
# DSL (pinned by vLLM) need; ModelOpt configs then fail to import.
WHEEL_CONSTRAINTS = ["cuda-python>=13"]


def venv_python(project: Project) -> Path:
    return project.work / "venv" / "bin" / "python"


def uv_env() -> dict[str, str]:
    """uv never downloads a Python interpreter for the harness."""
    return {"UV_PYTHON_DOWNLOADS": "never", "UV_PYTHON_PREFERENCE": "only-system"}


def make_venv(project: Project, root: Path) -> Path:
    """A new uv venv at ``root`` with the pinned Python (``patches/base.toml``); its python."""
    run(["uv", "venv", "--python", project.pin.python, str(root)], env=uv_env())
    return root / "bin" / "python"


def ensure_venv(project: Project, requirements: list[str]) -> Path:
    """The harness venv (uv), with ``requirements`` installed; reused when unchanged."""
    python = venv_python(project)
    if not python.exists():
        make_venv(project, python.parent.parent)
    stamp = python.parent.parent / ".harness-requirements"
    wanted = "\n".join(sorted(requirements))
    if not stamp.exists() or wanted not in stamp.read_text():
        run(
            ["uv", "pip", "install", "--python", str(python), *requirements],
            env={**uv_env(), "PIP_CONSTRAINT": ""},
        )
        with stamp.open("a") as fh:
            fh.write(wanted + "\n")
    return python


def _overrides(project: Project) -> str:
    """``patches/base.toml``'s overrides of the release wheel's pins, one requirement a line."""
    return "".join(f"{req}\n" for req, _ in project.pin.overrides)


def install(project: Project, python: Path, wheel: str, *options: str) -> None:
    """``uv pip install`` ``wheel`` into the venv of ``python``, as docs/serving.md says.

    With it: the release's torch, :data:`WHEEL_CONSTRAINTS`, and ``patches/base.toml``'s
    overrides, which replace the wheel's own pins (one it names that the index does not
    serve), written to ``overrides.txt`` in that venv. ``options`` go before the wheel.
    """
    overrides = python.parent.parent / "overrides.txt"
    wanted = _overrides(project)
    for req, why in project.pin.overrides:
        progress(f"override on vLLM {project.pin.release.version}: {req} ({why})")
    overrides.write_text(wanted)
    run(
        [
            "uv",
            "pip",
            "install",
            "--python",
            str(python),
            *options,
            wheel,
            # the selected release's torch (each release's work area has its own venv)
            f"torch=={project.pin.torch}",
            *WHEEL_CONSTRAINTS,
            *(["--override", str(overrides)] if wanted else []),
        ],
        env={**uv_env(), "PIP_CONSTRAINT": ""},
    )


def install_wheel(project: Project, wheel: str, wheel_sha256: str) -> Path:
    """The harness venv with the test requirements and ``wheel`` (and its dependencies)."""
    python = ensure_venv(project, [toolpins.pin(name) for name in TEST_REQUIREMENTS])
    stamp = python.parent.parent / ".harness-wheel"
    wanted = wheel_sha256 + _overrides(project)
    if not stamp.exists() or stamp.read_text() != wanted:
        progress(f"installing {Path(wheel).name} into the harness venv")
        install(project, python, wheel, "--reinstall-package", "vllm")
        stamp.write_text(wanted)
    return python
