"""Stage 3: the python-only build refuses compiled changes it cannot carry; the wheel it
builds is named on the last line and in ``dist/LATEST``."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from harness import __main__ as cli
from harness import build, series
from harness.project import HarnessError


def test_python_only_build_refuses_csrc_changes(project, commit):
    commit("[Kernel] Change a kernel", {"csrc/kernel.cu": "int kernel() { return 2; }\n"})
    series.export(project)
    assert build.compiled_changes(project.tree, project.pin.base_commit) == ["csrc/kernel.cu"]
    with pytest.raises(HarnessError, match=r"csrc/kernel.cu[\s\S]*harness kernels"):
        build.build(project)


def test_python_changes_are_not_compiled_changes(project, commit):
    commit("[Core] Python only", {"vllm/__init__.py": "VALUE = 3\n", "setup.py.txt": "x\n"})
    assert build.compiled_changes(project.tree, project.pin.base_commit) == []


def test_build_refuses_unexported_commits(project, commit):
    commit("[Core] Python only", {"vllm/__init__.py": "VALUE = 3\n"})
    with pytest.raises(HarnessError, match="not in patches/"):
        build.build(project)


def test_build_writes_the_wheels_absolute_path_to_latest(project, commit, monkeypatch, tmp_path):
    """The wheel keeps its own name; ``dist/LATEST`` holds its absolute path (uv build and
    the venv are stubbed: they are what takes minutes)."""
    commit("[Core] Python only", {"vllm/__init__.py": "VALUE = 3\n"})
    series.export(project)
    name = "vllm-1.0.0+series.x.precompiled-cp311-cp311-linux_x86_64.whl"

    def fake_uv_build(cmd, **kwargs):
        (Path(cmd[cmd.index("--out-dir") + 1]) / name).write_bytes(b"wheel")

    monkeypatch.setattr(build, "ensure_venv", lambda project, requirements: tmp_path / "python")
    monkeypatch.setattr(build, "build_requirements", lambda tree: [])
    monkeypatch.setattr(build, "fetch", lambda *args: tmp_path / "release.whl")
    monkeypatch.setattr(build, "run", fake_uv_build)
    monkeypatch.chdir(project.root)
    relative = dataclasses.replace(project, work=Path(os.path.relpath(project.work)))
    info = build.build(relative)
    wheel = project.work.resolve() / "dist" / name
    assert info.wheel == str(wheel)
    assert (project.work / "dist" / build.LATEST).read_text() == f"{wheel}\n"
    assert build.built(project) == info


def test_build_prints_the_wheel_last(monkeypatch, capsys):
    info = build.BuildInfo("/abs/vllm.whl", "0", "python-only", (), "x", "c")
    monkeypatch.setattr(build, "build", lambda project, **kwargs: info)
    assert cli.main(["build", "--stock-kernels"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "wheel: /abs/vllm.whl"
