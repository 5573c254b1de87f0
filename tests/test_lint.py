"""lint: tool pins come from the tree's pre-commit config; only new mypy errors count."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from harness import lint, toolpins
from harness.project import REPO, HarnessError

CONFIG = """repos:
- repo: https://example.invalid/astral-sh/ruff-pre-commit
  rev: v0.14.0
- repo: https://example.invalid/crate-ci/typos
  rev: v1.43.5
  - id: mypy
    additional_dependencies: ["mypy==1.20.2", regex, types-cachetools]
"""


def test_pinned_tools_follow_the_tree(tmp_path):
    """The tree's pins stay the tree's (the lock has other ruff and mypy versions); what
    it leaves unpinned gets the lock's version."""
    (tmp_path / ".pre-commit-config.yaml").write_text(
        CONFIG.replace("types-cachetools]", 'types-cachetools, "pydantic==2.13.5", "pip>=9"]')
    )
    locked = toolpins.read_lock(REPO / toolpins.LOCK)
    assert lint.pinned_tools(tmp_path) == [
        "ruff==0.14.0",
        "typos==1.43.5",
        "mypy==1.20.2",
        f"regex=={locked['regex']}",
        f"types-cachetools=={locked['types-cachetools']}",
        "pydantic==2.13.5",
        "pip>=9",
        f"PyYAML=={locked['pyyaml']}",
    ]
    assert locked["ruff"] != "0.14.0" and locked["mypy"] != "1.20.2"


def test_a_hook_dependency_the_lock_lacks_is_refused_with_the_fix(tmp_path):
    (tmp_path / ".pre-commit-config.yaml").write_text(
        CONFIG.replace("types-cachetools]", "types-cachetools, types-newthing]")
    )
    with pytest.raises(HarnessError, match=r"types-newthing is not in .*tools\.lock: add it to "):
        lint.pinned_tools(tmp_path)


def test_pinned_tools_read_revisions_frozen_to_commits(tmp_path):
    # vLLM 0.34.0 pins each hook by commit, its version in a `# frozen:` comment
    frozen = CONFIG.replace(
        "rev: v0.14.0", "rev: f368fb366ff7f2f808dd324b83a6d32267799e19  # frozen: v0.17.2"
    ).replace("rev: v1.43.5", "rev: 9023c1f779400877cafdd98052113fc777e2cfdc  # frozen: v1.51.1")
    (tmp_path / ".pre-commit-config.yaml").write_text(frozen)
    assert lint.pinned_tools(tmp_path)[:2] == ["ruff==0.17.2", "typos==1.51.1"]


def test_only_mypy_errors_the_series_adds_count(project, commit, monkeypatch):
    commit("[Core] Touch", {"vllm/__init__.py": "VALUE = 2\n", "vllm/new.py": "x = 1\n"})
    seen: list[tuple[Path, list[str], Path]] = []

    def fake(tree: Path, files: list[str], python: Path, cache: Path) -> Counter[str]:
        seen.append((tree, files, cache))
        old = Counter({"vllm/__init__.py: error A  [misc]": 1})
        if tree == project.tree:
            return old + Counter({"vllm/__init__.py: error B  [misc]": 1})
        return old

    monkeypatch.setattr(lint, "_mypy_errors", fake)
    files = ["vllm/__init__.py", "vllm/new.py"]
    cache = project.work / "mypy-cache"
    new = lint.new_mypy_errors(project.tree, project.pin.base_commit, files, Path("python"), cache)
    assert new == ["vllm/__init__.py: error B  [misc]"]
    # The base run only checks files that exist there.
    assert seen[1][1] == ["vllm/__init__.py"]
    # Both runs use one incremental cache: the base's reuses what the series' checked.
    assert [c for _, _, c in seen] == [cache, cache]


def test_mypy_output_is_parsed_without_line_numbers():
    text = "vllm/a.py:12: error: Bad thing  [misc]\nvllm/a.py:3: note: hint\nFound 1 error\n"
    assert [m["path"] + ": " + m["message"] for m in lint._MYPY_ERROR.finditer(text)] == [
        "vllm/a.py: Bad thing  [misc]"
    ]
