"""The harness's tests that need vLLM itself, run against the built wheel.

``python -m harness selftest`` runs ``tests/wheel/`` with the harness venv's
Python (the venv ``python -m harness test`` installs the built wheel into), so
what they check is the vLLM the series ships: today, that vLLM 0.33.0 reads the
synthetic checkpoint of :mod:`harness.checkpoint` as a ModelOpt NVFP4 MoE model,
and that the wheel installs into a fresh venv as docs/serving.md says, where
``vllm serve`` lists the pool's flags and refuses the pool on a model without experts.
The ``harness`` nox session's venv has no vLLM and never collects these tests
(``tests/wheel/conftest.py``); here a missing vLLM fails, and so does a run that
collects nothing.
"""

from __future__ import annotations

import os
import subprocess

from harness import build, venv
from harness.project import HarnessError, Project, progress

WHEEL_TESTS = "tests/wheel"


def run(project: Project, pytest_args: list[str] | None = None) -> int:
    """pytest over ``tests/wheel`` in the harness venv; its exit code (5, nothing ran, is 1)."""
    info = build.built(project)
    python = venv.install_wheel(project, info.wheel, info.wheel_sha256)
    progress(f"running {WHEEL_TESTS} with {python}")
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", WHEEL_TESTS,
         *(pytest_args or [])],
        cwd=project.root,
        env={**os.environ, "HARNESS_WHEEL_TESTS": "1", "PYTHONPATH": str(project.root)},
        check=False,
    )  # fmt: skip
    if proc.returncode == 5:
        raise HarnessError(f"selftest collected no tests from {WHEEL_TESTS}")
    return proc.returncode
