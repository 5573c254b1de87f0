"""vLLM's own checks, on the files the series touches.

The checks and tool versions are the patched tree's: ruff and typos at the
revisions its ``.pre-commit-config.yaml`` pins, mypy (and the hook dependencies
it pins) through its ``tools/pre_commit/mypy.py`` (Python 3.11), and its local
hooks for SPDX headers, test tethering, ``torch.cuda`` calls, config
docstrings, forbidden imports and boolean context managers. The hook
dependencies the config leaves unpinned get harness/data/tools.lock's versions.
They run in the harness venv, which has the built wheel installed, so mypy
resolves vLLM's dependencies.

mypy runs twice, on the series and on its base (only the errors the series
adds count), with one incremental cache in the work area: the base's run
re-checks only the modules the series changes and those that depend on them,
and reuses the rest (most of vLLM, torch and the other dependencies it
follows), which mypy validates against each file's contents.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path

from harness import build, series, toolpins, venv
from harness.applying import scratch_tree
from harness.project import HarnessError, Project, git, progress

# Local hooks of vLLM's pre-commit config that take file names, and what they check.
LOCAL_HOOKS = {
    "check_spdx_header.py": "SPDX headers",
    "check_torch_cuda.py": "no new torch.cuda calls",
    "validate_config.py": "config fields have defaults and docstrings",
    "check_forbidden_imports.py": "forbidden imports",
    "check_boolean_context_manager.py": "boolean ops in with-statements",
}


def pinned_tools(tree: Path) -> list[str]:
    """ruff, typos and mypy (with its stub packages) as the tree's pre-commit pins them;
    what it installs without a version (and PyYAML, which its hooks import) at the version
    of harness/data/tools.lock."""
    config = (tree / ".pre-commit-config.yaml").read_text()

    def rev(repo: str) -> str:
        # `rev: v0.17.2`, or a commit frozen by `pre-commit autoupdate --freeze`:
        # `rev: <sha>  # frozen: v0.17.2` (vLLM 0.34.0)
        match = re.search(
            rf"repo: \S*/{repo}\s+rev: (?:[0-9a-f]{{40}}\s+# frozen: )?v?([\w.]+)", config
        )
        if not match:
            raise HarnessError(f"no {repo} revision in the tree's .pre-commit-config.yaml")
        return match.group(1)

    mypy = re.search(r"additional_dependencies: \[(\"mypy==[^\]]*)\]", config)
    if not mypy:
        raise HarnessError("no mypy pin in the tree's .pre-commit-config.yaml")
    mypy_deps = [d.strip().strip('"') for d in mypy.group(1).split(",")]
    return [
        f"ruff=={rev('ruff-pre-commit')}",
        f"typos=={rev('typos')}",
        # a bare name gets the lock's version; one the tree constrains keeps the tree's
        *(toolpins.pin(d) if re.fullmatch(r"[\w.-]+", d) else d for d in [*mypy_deps, "PyYAML"]),
    ]


def lint(project: Project) -> list[str]:
    """``python -m harness lint``: run the checks; return the names of those that failed."""
    tree, base = series.prepare(project)
    series.ensure_clean(tree)
    changed = git(tree, "diff", "--name-only", "--diff-filter=AM", f"{base}..HEAD").stdout.split()
    python_files = [f for f in changed if f.endswith(".py")]
    if not changed:
        progress("the series changes no files; nothing to lint")
        return []
    info = build.built(project)
    python = venv.install_wheel(project, info.wheel, info.wheel_sha256)
    venv.ensure_venv(project, pinned_tools(tree))
    bindir = python.parent
    checks: list[tuple[str, list[str]]] = [
        ("typos", [str(bindir / "typos"), "--force-exclude", *changed]),
    ]
    if python_files:
        checks += [
            ("ruff check", [str(bindir / "ruff"), "check", *python_files]),
            ("ruff format", [str(bindir / "ruff"), "format", "--check", "--diff", *python_files]),
            (
                "test tethering",
                [
                    str(python),
                    "tools/pre_commit/check_test_tethering.py",
                    *[f for f in python_files if f.startswith("tests/")],
                ],
            ),
        ]
        checks += [
            (what, [str(python), f"tools/pre_commit/{hook}", *python_files])
            for hook, what in LOCAL_HOOKS.items()
        ]
    failed = []
    for name, cmd in checks:
        progress(f"lint: {name}")
        proc = _run_in(tree, cmd, bindir)
        if proc.returncode != 0:
            failed.append(name)
            print(f"--- {name} failed ---\n{proc.stdout}{proc.stderr}")
    if python_files:
        progress("lint: mypy (errors the base already has in these files do not count)")
        cache = project.work / "mypy-cache"
        if new := new_mypy_errors(tree, base, python_files, python, cache):
            failed.append("mypy")
            print("--- mypy failed: errors the series adds ---\n" + "\n".join(new))
    return failed


def _run_in(
    tree: Path, cmd: list[str], bindir: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a check in ``tree`` with the venv's tools first on ``PATH`` (and ``env`` set)."""
    path = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run(
        cmd,
        cwd=tree,
        env={**os.environ, "PATH": path, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )


_MYPY_ERROR = re.compile(r"^(?P<path>[^:\s]+\.pyi?):\d+: error: (?P<message>.*)$", re.M)


def _mypy_errors(tree: Path, files: list[str], python: Path, cache: Path) -> Counter[str]:
    """vLLM's mypy hook on ``files`` in ``tree``, its cache in ``cache``: errors without
    their line numbers."""
    proc = _run_in(
        tree,
        [str(python), "tools/pre_commit/mypy.py", "3.11", *files],
        python.parent,
        {"MYPY_CACHE_DIR": str(cache)},
    )
    return Counter(f"{m['path']}: {m['message']}" for m in _MYPY_ERROR.finditer(proc.stdout))


def new_mypy_errors(
    tree: Path, base: str, files: list[str], python: Path, cache: Path
) -> list[str]:
    """mypy errors in ``files`` that the series introduces.

    vLLM's mypy hook checks whole files, and some files vLLM ships already
    have errors under the pinned tool versions; only errors beyond the base's
    (compared without line numbers, which the series shifts) are the series'.
    Both runs share the incremental cache ``cache``.
    """
    after = _mypy_errors(tree, files, python, cache)
    existing = [
        f
        for f in files
        if (tree / f).exists()
        and git(tree, "cat-file", "-e", f"{base}:{f}", check=False).returncode == 0
    ]
    with scratch_tree(tree, base) as before_tree:
        before = _mypy_errors(before_tree, existing, python, cache) if existing else Counter()
    return sorted((after - before).elements())
