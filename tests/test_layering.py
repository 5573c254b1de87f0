"""The harness package is layered: every module imports alone, and imports form no cycle.

Imports are read from the source (module level and inside functions alike: a
lazy import is still a dependency), so the test needs none of the optional
packages the modules use.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODULES = sorted(p.stem for p in (ROOT / "harness").glob("*.py") if p.stem != "__init__")

# Leaves: what the rest stands on. Each may use only the standard library and
# the modules listed here.
LEAVES = {
    "project": set(),
    "patches": {"project"},
    "results": {"project", "patches"},
    "toolpins": {"project"},
    "venv": {"project", "toolpins"},
    "touched": {"project"},
    "device_run": set(),  # travels alone to GPU hosts
}


def harness_imports(module: str) -> set[str]:
    """The ``harness`` modules that ``harness/<module>.py`` imports."""
    tree = ast.parse((ROOT / "harness" / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "harness":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("harness."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("harness.")}
    return found - {module}


def test_the_import_graph_has_no_cycle() -> None:
    graph = {m: harness_imports(m) for m in MODULES}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycle = [*path[path.index(dep) :], dep] if dep in path else [node, dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_modules_stay_leaves(leaf: str) -> None:
    assert harness_imports(leaf) <= LEAVES[leaf]


def test_each_module_imports_alone() -> None:
    script = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.startswith('harness')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module('harness.' + name)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, *MODULES], cwd=ROOT, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_the_bundle_runner_and_results_agree_on_the_tree_variable() -> None:
    from harness import device_run, results

    assert device_run.BUNDLE_TREE_ENV == results.BUNDLE_TREE_ENV
