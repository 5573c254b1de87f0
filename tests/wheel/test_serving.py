"""README's "Use it" path in a fresh venv: the built wheel installs and serves as documented.

The wheel goes into a new uv venv of the pinned Python with :func:`harness.venv.install`,
the command docs/serving.md gives (``tests/test_readme.py`` keeps the two equal). That
venv's ``vllm serve`` must then list the pool's flags, and refuse the pool on a model
whose config declares no experts with the message docs/serving.md quotes.

No GPU is needed: vLLM cannot infer a device without one, so the commands run with
``VLLM_TARGET_DEVICE=cpu``, and both stop before any kernel runs. The install comes
from uv's cache, which installing the same wheel into the harness venv filled (a few
seconds); most of the minute the module takes is vLLM importing, once per command.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from harness import build, checkpoint, venv
from harness.project import Project

ROOT = Path(__file__).resolve().parents[2]
SERVING = ROOT / "docs" / "serving.md"
POOL_FLAGS = (
    "--moe-expert-pool-rows",
    "--moe-expert-pool-gb",
    "--moe-expert-pool-prefill-staging",
    "--moe-expert-pool-prefill-staging-min-tokens",
)
#: vLLM on a host without a GPU, offline and without usage reports.
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``bin/`` of a fresh venv with the built wheel, installed as docs/serving.md says."""
    project = Project.discover()
    python = venv.make_venv(project, tmp_path_factory.mktemp("serving") / "venv")
    venv.install(project, python, build.built(project).wheel)
    return python.parent


def vllm(bin_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``vllm ARGS`` of the venv, as a user runs it (its output captured)."""
    return subprocess.run(
        [str(bin_dir / "vllm"), *args],
        env={**os.environ, **CPU_ENV},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def documented(needle: str) -> str:
    """The message docs/serving.md quotes that contains ``needle``."""
    (line,) = [line for line in SERVING.read_text().splitlines() if needle in line]
    return line.strip()


def test_serve_help_lists_the_pools_flags(bin_dir: Path) -> None:
    shown = vllm(bin_dir, "serve", "--help=OffloadConfig")
    assert shown.returncode == 0, shown.stderr[-2000:]
    flags = set(re.findall(r"^\s+(--[\w-]+)", shown.stdout, re.M))
    assert [flag for flag in POOL_FLAGS if flag not in flags] == []


def test_serve_refuses_the_pool_on_a_model_without_experts(bin_dir: Path, tmp_path: Path) -> None:
    dense = checkpoint.write(tmp_path / "dense", checkpoint.Spec(dense=True))
    served = vllm(
        bin_dir, "serve", str(dense), "--moe-backend", "marlin", "--moe-expert-pool-rows", "32"
    )
    message = documented("is not a mixture-of-experts model").replace("<checkpoint>", str(dense))
    assert served.returncode != 0
    assert message in served.stderr, served.stderr[-2000:]
