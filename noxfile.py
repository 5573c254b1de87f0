"""nox sessions: a thin layer over ``python -m harness`` (see README.md).

``nox -s apply build test`` is the main job; plain ``nox`` runs everything CI
runs. Sessions stop at the first failure, and neither nox nor uv downloads a
Python interpreter.

``VLLM_SERIES_VLLM=0.32.0 nox -s apply build test`` runs the same sessions on
another release pinned in ``patches/base.toml``, in its own work area. The
release is chosen by an environment variable rather than by ``-- --vllm``:
nox hands one list of posargs to every session of a run, and ``test`` passes
its posargs to pytest, so each session would have to pick the option out of
them; the variable reaches ``python -m harness`` in every session unchanged,
works without nox, and is what a CI job sets per release.
"""

from __future__ import annotations

import os

import nox

nox.needs_version = ">=2026.8.10"
nox.options.default_venv_backend = "uv"
nox.options.stop_on_first_error = True
nox.options.error_on_missing_interpreters = True
nox.options.download_python = "never"
nox.options.sessions = ["harness", "apply", "check", "build", "test", "lint"]
os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")

PYTHON = "3.11"
# Every tool a session installs, and what they need, at one version each
# (harness.toolpins; `nox -s lock` remakes it).
LOCK = "harness/data/tools.lock"


def _harness(session: nox.Session, *args: str) -> None:
    session.run("python", "-m", "harness", *args, external=True)


@nox.session(python=PYTHON)
def harness(session: nox.Session) -> None:
    """The harness's own tests (fast, offline) plus ruff (lint and format) and mypy on it."""
    # matplotlib: harness.replay's plots; pip: the device runner installs the
    # carried wheels with it, as it does on a GPU host; pytest-xdist: the tests
    # run on every CPU nox may use (its affinity: `-n auto` counts the host's cores).
    session.install(
        "--constraint", LOCK, "pytest", "pytest-xdist", "ruff", "mypy", "matplotlib", "pip", "numpy"
    )
    session.run("ruff", "check", "harness", "tests", "noxfile.py", "scripts")
    session.run("ruff", "format", "--check", "harness", "tests", "noxfile.py", "scripts")
    session.run("mypy", "harness")
    workers = len(os.sched_getaffinity(0))
    session.run("pytest", "-q", f"--numprocesses={workers}", "tests", *session.posargs)


@nox.session(venv_backend="none")
def base(session: nox.Session) -> None:
    """Fetch, verify and materialize the pinned vLLM base as a git tree."""
    _harness(session, "base")


@nox.session(venv_backend="none")
def apply(session: nox.Session) -> None:
    """Apply patches/ on the base as commits (refuses unexported work)."""
    _harness(session, "apply")


@nox.session(venv_backend="none")
def export(session: nox.Session) -> None:
    """Regenerate patches/ (`-- --force`; `-- --signoff 'Name <email>' --out DIR`: submission)."""
    _harness(session, "export", *session.posargs)


@nox.session(venv_backend="none")
def check(session: nox.Session) -> None:
    """Round trip byte for byte, standalone commits, SERIES.md up to date."""
    _harness(session, "check")


@nox.session(venv_backend="none")
def build(session: nox.Session) -> None:
    """Python-only wheel of the series; compiled changes are built by `nox -s kernels`."""
    _harness(session, "build", "--stock-kernels", *session.posargs)


@nox.session(venv_backend="none")
def test(session: nox.Session) -> None:
    """The series' tests against the built wheel (pytest args after `--`), then tests/wheel."""
    _harness(session, "test", *session.posargs)
    _harness(session, "selftest")


@nox.session(venv_backend="none", default=False)
def replay(session: nox.Session) -> None:
    """End-to-end replay on a GPU host (`-- ttft --profile glm53-tp2`, `-- e2e`; `--dry-run`)."""
    _harness(session, "replay", *session.posargs)


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """vLLM's own checks on the files the series touches."""
    _harness(session, "lint")


@nox.session(venv_backend="none", default=False)
def kernels(session: nox.Session) -> None:
    """Build the series' and the base's Marlin MoE op subsets (`-- --arch 9.0` without a GPU)."""
    _harness(
        session, "kernels", "--rev", "series", "--namespace", "marlin_series", *session.posargs
    )
    _harness(session, "kernels", "--rev", "base", "--namespace", "marlin_base", *session.posargs)


@nox.session(venv_backend="none", default=False)
def bundle(session: nox.Session) -> None:
    """Pack the device bundle for a GPU host without network (see docs/device-bundle.md)."""
    _harness(session, "bundle", *session.posargs)


@nox.session(venv_backend="none", default=False)
def matrix(session: nox.Session) -> None:
    """Classify every pinned release's series on it (`-- --test`: then apply, build, test)."""
    _harness(session, "matrix", *session.posargs)


@nox.session(venv_backend="none", default=False)
def pin(session: nox.Session) -> None:
    """Pin a release from the index (`-- 0.35.0`), or list newer ones (`-- --newer`)."""
    _harness(session, "pin", *session.posargs)


@nox.session(venv_backend="none", default=False)
def lock(session: nox.Session) -> None:
    """Re-resolve harness/data/tools.lock and show what changed (`-- --upgrade`: newest)."""
    _harness(session, "lock", *session.posargs)


@nox.session(venv_backend="none")
def doc(session: nox.Session) -> None:
    """Regenerate SERIES.md's generated blocks."""
    _harness(session, "doc")
