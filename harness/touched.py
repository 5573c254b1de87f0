"""The files a revision of the series adds or changes, below a folder of the tree."""

from __future__ import annotations

from pathlib import Path

from harness.project import git


def touched_files(tree: Path, base: str, revision: str = "HEAD", under: str = "tests") -> list[str]:
    """Files below ``under`` that ``base..revision`` adds or changes."""
    return sorted(
        git(
            tree, "diff", "--name-only", "--diff-filter=AM", f"{base}..{revision}", "--", under
        ).stdout.split()
    )


def touched_tests(tree: Path, base: str, revision: str = "HEAD") -> list[str]:
    """Test files (``tests/**/test_*.py``) that ``base..revision`` adds or changes.

    ``revision`` defaults to the checked-out commit (``harness test``); the
    device bundle passes the commit it packs.
    """
    return [
        n
        for n in touched_files(tree, base, revision)
        if Path(n).name.startswith("test_") and n.endswith(".py")
    ]
