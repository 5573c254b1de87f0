"""Stage 3: the python-only build refuses compiled changes it cannot carry."""

from __future__ import annotations

import pytest

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
