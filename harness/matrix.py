"""The revision matrix: how each commit of the series meets other vLLM releases.

For every release in ``patches/base.toml`` (``[[matrix]]`` plus the base
itself), each patch is applied after the prerequisites its note names, in a
fresh clone whose objects are only that release's and the pinned base's (what
an upstream clone has; never the series' own blobs), and classified:
``clean``, ``3way``, ``rebase`` (with the failing files), ``upstream``
(already there), or ``blocked`` when a prerequisite already failed. The JSON
lands in ``results/matrix.json`` and SERIES.md renders it.
"""

from __future__ import annotations

from typing import Any

from harness import document, results, series
from harness.applying import apply_alone, base_store, fresh_clone
from harness.base import materialize
from harness.patches import load_notes, series_files
from harness.project import Project, Release, git, progress


def classify(project: Project, release: Release) -> dict[str, dict[str, Any]]:
    """One column of the matrix: ``{patch name: {"outcome": ..., "files": [...]}}``."""
    pin = project.pin
    base_tree, _ = series.prepare(project)
    sources = [(base_tree, pin.release.tag)]
    if release == pin.release:
        base = pin.base_commit
    else:
        tree = project.work / "matrix" / release.version
        base = materialize(project, release, tree, pin.identity)
        # With the pinned base's blobs as well, git am's 3-way fallback can
        # work as it does in an upstream clone that has both releases.
        sources.insert(0, (tree, release.tag))
    patches = series_files(project)
    notes = load_notes(project)
    cells: dict[str, dict[str, Any]] = {}
    with base_store(sources) as store, fresh_clone(store, base) as clone:
        for patch in patches:
            prereqs = [patches[i - 1] for i in notes[patch.name].requires]
            applied = apply_alone(clone, base, [*prereqs, patch], pin.identity, three_way=True)
            last = applied[-1]
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
            for p in series_files(project)
        ],
    }
    prov = results.provenance("nox -s matrix")
    results.write(project.results / "matrix.json", "revision-matrix", data, prov)
    document.update(project)
    return data
