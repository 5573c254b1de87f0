"""The harness's tool versions: one lock file, read here, remade on purpose.

``harness/data/tools.in`` names the tools the harness installs (nox's
``harness`` session, the harness venv's test requirements, lint's unpinned
hook dependencies); ``harness/data/tools.lock`` pins them and everything they
need to one version each (``uv pip compile``, Python 3.11, Linux x86-64), so a
new release of a tool cannot change a run until the lock is remade.

:func:`pin` gives the locked ``name==version`` of a tool. :func:`relock`
(``python -m harness lock [--upgrade]``) re-resolves the lock and returns what
changed. Where vLLM's own tree pins a tool (ruff, typos, mypy and pydantic in
its pre-commit config) the tree's version is used, never this lock's.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from harness.project import REPO, HarnessError, run

# Relative to the repository root.
REQUIREMENTS = Path("harness/data/tools.in")
LOCK = Path("harness/data/tools.lock")
# What the lock is resolved for: the harness's Python (noxfile.py, patches/base.toml)
# on the platform CI runs on.
PYTHON = "3.11"
PLATFORM = "x86_64-unknown-linux-gnu"

_PINNED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def canonical(name: str) -> str:
    """A package name as the index compares names (PEP 503): ``PyYAML`` is ``pyyaml``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """Each package of the lock file ``path`` (canonical name) and its version."""
    if not path.is_file():
        raise HarnessError(f"no {path}: make it with `python -m harness lock`")
    return {
        canonical(match.group(1)): match.group(2)
        for line in path.read_text().splitlines()
        if (match := _PINNED.match(line))
    }


def pin(name: str, root: Path = REPO) -> str:
    """``name==version`` with the version ``root``'s lock pins ``name`` to."""
    version = read_lock(root / LOCK).get(canonical(name))
    if version is None:
        raise HarnessError(
            f"{name} is not in {LOCK}: add it to {REQUIREMENTS} (under who installs it) "
            "and run `python -m harness lock`"
        )
    return f"{name}=={version}"


@dataclasses.dataclass(frozen=True)
class LockChange:
    """What remaking the lock changed: ``(name, old, new)`` versions, and the packages
    it added or removed with their versions."""

    changed: list[tuple[str, str, str]]
    added: list[tuple[str, str]]
    removed: list[tuple[str, str]]

    @classmethod
    def between(cls, old: dict[str, str], new: dict[str, str]) -> LockChange:
        return cls(
            changed=[
                (n, old[n], new[n]) for n in sorted(old.keys() & new.keys()) if old[n] != new[n]
            ],
            added=[(n, new[n]) for n in sorted(new.keys() - old.keys())],
            removed=[(n, old[n]) for n in sorted(old.keys() - new.keys())],
        )

    def lines(self) -> list[str]:
        """One line a package, ``name old -> new``, ``added name==version`` or
        ``removed name==version``; a single line when nothing changed."""
        if not (self.changed or self.added or self.removed):
            return [f"{LOCK}: unchanged"]
        return [
            *(f"{name} {old} -> {new}" for name, old, new in self.changed),
            *(f"added {name}=={version}" for name, version in self.added),
            *(f"removed {name}=={version}" for name, version in self.removed),
        ]


def relock(root: Path = REPO, *, upgrade: bool = False) -> LockChange:
    """Re-resolve ``root``'s lock from its requirements with ``uv pip compile``.

    Without ``upgrade`` the versions already locked are kept where the
    requirements allow (a tool added or removed changes only what it needs);
    with it every package gets the newest version that resolves.
    """
    old = read_lock(root / LOCK) if (root / LOCK).is_file() else {}
    run(
        [
            "uv", "pip", "compile", str(REQUIREMENTS), "--output-file", str(LOCK),
            "--python-version", PYTHON, "--python-platform", PLATFORM,
            "--custom-compile-command", "python -m harness lock", "--quiet",
            *(["--upgrade"] if upgrade else []),
        ],
        cwd=root,
    )  # fmt: skip
    return LockChange.between(old, read_lock(root / LOCK))
