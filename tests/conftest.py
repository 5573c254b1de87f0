"""Fixtures: a synthetic release sdist and a project laid out like this one.

Nothing here touches the network or the real vLLM release: the "release" is a
tiny tarball made in a temporary directory, placed in a temporary cache with
its hash pinned in a temporary ``patches/base.toml``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import signal
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from harness import base
from harness.project import Identity, Project, git

# A shell starts background jobs with SIGINT ignored, and the children the tests start
# (the fake vLLM, the replays of device_run) inherit that: the SIGINT by which the
# harness stops them would then do nothing. Tests of that stop need it delivered.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

IDENTITY = Identity("Series Bot", "bot@example.invalid", "2026-01-01T00:00:00+00:00")

FILES = {
    "setup.py": "print('setup')\n",
    "csrc/kernel.cu": "int kernel() { return 1; }\n",
    "vllm/__init__.py": "VALUE = 1\n",
    "vllm/layer.py": "".join(f"line {i}\n" for i in range(40)),
    "tests/test_layer.py": "def test_value():\n    assert True\n",
}


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str) -> ModuleType:
    """Import ``scripts/<name>.py`` as a module, with ``scripts/`` on the path
    while it runs (the scripts import their siblings)."""
    path = SCRIPTS / f"{name}.py"
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def make_sdist(path: Path, version: str, files: dict[str, str]) -> str:
    """Write a gzip'd tarball ``vllm-<version>/...``; return its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, content in sorted(files.items()):
            data = content.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return hashlib.sha256(buf.getvalue()).hexdigest()


def pin_release(
    project: Project, version: str, files: dict[str, str], series: str | None = None
) -> Project:
    """Pin ``version`` (an sdist of ``files``) as a ``[[matrix]]`` release beside the
    fixture's base, with everything the pipeline needs; its base is made and pinned.
    ``series`` names its backport folder under ``patches/``."""
    sha = make_sdist(project.cache / "dist" / f"vllm-{version}.tar.gz", version, files)
    pin_file = project.patches / "base.toml"
    entry = (
        f'\n[[matrix]]\nversion = "{version}"\nsdist_sha256 = "{sha}"\nupstream_commit = "0"\n'
        f'base_commit = "unknown"\nwheel = "vllm-{version}-none.whl"\nwheel_sha256 = "0"\n'
        'torch = "2.13.0"\nflashinfer = "0"\n' + (f'series = "{series}"\n' if series else "")
    )
    pin_file.write_text(pin_file.read_text() + entry)
    release = project.for_release(version)
    made = base.materialize(release, release.pin.release, release.tree, release.pin.identity)
    pinned = pin_file.read_text().replace('base_commit = "unknown"', f'base_commit = "{made}"')
    pin_file.write_text(pinned)
    return project.for_release(version)


def write_pin(root: Path, version: str, sha: str, base_commit: str) -> None:
    (root / "patches").mkdir(parents=True, exist_ok=True)
    (root / "patches" / "base.toml").write_text(
        f"""[base]
project = "vllm"
version = "{version}"
tag = "v{version}"
upstream_commit = "0000000"
base_commit = "{base_commit}"
sdist = "vllm-{version}.tar.gz"
sdist_sha256 = "{sha}"
wheel = "vllm-{version}-none.whl"
wheel_sha256 = "0"
torch = "2.14.0"
flashinfer = "0.7.2.post1"
python = "3.11"

[identity]
name = "{IDENTITY.name}"
email = "{IDENTITY.email}"
date = "{IDENTITY.date}"
"""
    )


@pytest.fixture
def project(tmp_path: Path) -> Project:
    """A project whose pinned base (version 1.0.0) is cached and materialized."""
    proj = Project(root=tmp_path / "repo", cache=tmp_path / "cache", work=tmp_path / "work")
    (proj.cache / "dist").mkdir(parents=True)
    sha = make_sdist(proj.cache / "dist" / "vllm-1.0.0.tar.gz", "1.0.0", FILES)
    write_pin(proj.root, "1.0.0", sha, "unknown")
    commit = base.materialize(proj, proj.pin.release, proj.tree, proj.pin.identity)
    write_pin(proj.root, "1.0.0", sha, commit)
    (proj.patches / "series").write_text("")
    (proj.root / "SERIES.md").write_text("# series\n")
    return proj


CommitFn = Callable[[str, dict[str, str]], str]


@pytest.fixture
def commit(project: Project) -> CommitFn:
    """Make a commit on the project's tree: ``commit(subject, {path: content})``."""

    def make(subject: str, changes: dict[str, str]) -> str:
        for name, content in changes.items():
            target = project.tree / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        git(project.tree, "add", "--all")
        message = f"{subject}\n\nWhy it matters.\n\n{IDENTITY.signoff}\n"
        git(project.tree, "commit", "-q", "-m", message, env=IDENTITY.env())
        return git(project.tree, "rev-parse", "HEAD").stdout.strip()

    return make
