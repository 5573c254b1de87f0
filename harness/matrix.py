"""The revision matrix: how each commit of the series meets other vLLM releases.

For every release in ``patches/base.toml`` (``[[matrix]]`` plus the base
itself), each patch is applied in a scratch worktree on that release's sdist
tree, after the prerequisites its note names, and classified: ``clean``,
``3way``, ``rebase`` (with the failing files), ``upstream`` (a no-op there), or
``blocked`` when a prerequisite already failed. The JSON lands in
``results/matrix.json`` and SERIES.md renders it.
"""

from __future__ import annotations

from typing import Any

from harness import document, results, series
from harness.base import materialize
from harness.project import Project, Release, git, progress


def classify(project: Project, release: Release) -> dict[str, dict[str, Any]]:
    """One column of the matrix: ``{patch name: {"outcome": ..., "files": [...]}}``."""
    pin = project.pin
    if release == pin.release:
        tree, base = series.prepare(project)
    else:
        tree = project.work / "matrix" / release.version
        base = materialize(project, release, tree, pin.identity)
        # The pinned base's blobs make git am's 3-way fallback possible, as it
        # is in an upstream clone that has both releases.
        base_tree, _ = series.prepare(project)
        git(tree, "fetch", "-q", "--no-tags", str(base_tree), pin.release.tag)
    patches = series.series_files(project)
    notes = series.load_notes(project)
    cells: dict[str, dict[str, Any]] = {}
    for patch in patches:
        prereqs = [patches[i - 1] for i in notes[patch.name].requires]
        with series.scratch_tree(tree, base) as work:
            results = series.apply_series(work, [*prereqs, patch], pin.identity, abort=True)
        last = results[-1]
        if last.patch != patch.name:
            cells[patch.name] = {"outcome": "blocked", "files": [last.patch]}
        else:
            cells[patch.name] = {"outcome": last.outcome.value, "files": list(last.files)}
        progress(f"{release.version}: {patch.name}: {cells[patch.name]['outcome']}")
    return cells


def run_matrix(project: Project) -> dict[str, Any]:
    """``python -m harness matrix``: classify every patch on every release; write the JSON."""
    pin = project.pin
    releases = [*pin.matrix, pin.release]
    columns = {r.version: classify(project, r) for r in releases}
    data = {
        "git": git(project.root, "--version").stdout.strip(),
        "versions": [r.version for r in releases],
        "rows": [
            {"patch": p.name, "cells": {v: columns[v][p.name] for v in columns}}
            for p in series.series_files(project)
        ],
    }
    prov = results.provenance("nox -s matrix")
    results.write(project.results / "matrix.json", "revision-matrix", data, prov)
    document.update(project)
    return data
