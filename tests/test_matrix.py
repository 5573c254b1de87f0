"""The revision matrix classifies each patch per release and renders into SERIES.md."""

from __future__ import annotations

from harness import matrix, results, series
from harness.project import Release
from tests.conftest import FILES, make_sdist


def test_matrix_classifies_clean_rebase_and_upstream(project, commit):
    commit("[Core] Change value", {"vllm/__init__.py": "VALUE = 2\n"})
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 5\n", "line five\n")
    commit("[Core] Change layer", {"vllm/layer.py": layer})
    series.export(project)
    (project.patches / "notes.toml").write_text(
        '[[commit]]\npatch = "0001-Core-Change-value.patch"\nwhy = "a"\nupstream = "unmerged"\n\n'
        '[[commit]]\npatch = "0002-Core-Change-layer.patch"\nwhy = "b"\nupstream = "unmerged"\n'
    )
    # An older release where patch 1 is already in, and patch 2's context differs.
    old = dict(FILES)
    old["vllm/__init__.py"] = "VALUE = 2\n"
    old["vllm/layer.py"] = old["vllm/layer.py"].replace("line 4\n", "line four\n")
    old["vllm/other.py"] = "unrelated = 1\n"
    sha = make_sdist(project.cache / "dist" / "vllm-0.9.0.tar.gz", "0.9.0", old)
    release = Release("0.9.0", sha)
    cells = matrix.classify(project, release)
    assert cells["0001-Core-Change-value.patch"]["outcome"] == "upstream"
    # Adjacent lines changed on both sides: git's 3-way merge conflicts.
    assert cells["0002-Core-Change-layer.patch"].pop("seconds") >= 0
    assert cells["0002-Core-Change-layer.patch"] == {
        "outcome": "rebase",
        "files": ["vllm/layer.py"],
    }
    base_cells = matrix.classify(project, project.pin.release)
    assert {c["outcome"] for c in base_cells.values()} == {"clean"}


def test_matrix_json_renders_in_series_md(project):
    (project.root / "SERIES.md").write_text(
        "<!-- BEGIN GENERATED: matrix -->\n<!-- END GENERATED: matrix -->\n"
    )
    project.results.mkdir()
    prov = {k: "x" for k in results.REQUIRED}
    prov |= {"command": "nox -s matrix", "date": "2026-11-29T10:00:00+00:00", "series_hash": "abc"}
    results.write(
        project.results / "matrix.json",
        "revision-matrix",
        {
            "versions": ["0.9.0", "1.0.0"],
            "rows": [
                {
                    "patch": "0001-x.patch",
                    "cells": {
                        "0.9.0": {"outcome": "rebase", "files": ["a.py"]},
                        "1.0.0": {"outcome": "clean", "files": ["a.py"]},
                    },
                }
            ],
        },
        prov,
    )
    from harness import document

    document.update(project)
    text = (project.root / "SERIES.md").read_text()
    assert "| 0001-x.patch | rebase (a.py) | clean |" in text
    assert not document.stale(project)


def test_matrix_three_way_when_context_moved(project, commit):
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 30\n", "line thirty\n")
    commit("[Core] Change layer", {"vllm/layer.py": layer})
    series.export(project)
    (project.patches / "notes.toml").write_text(
        '[[commit]]\npatch = "0001-Core-Change-layer.patch"\nwhy = "a"\nupstream = "unmerged"\n'
    )
    # Far from the hunk, a nearby context line differs: exact apply fails, 3-way merges.
    old = dict(FILES)
    old["vllm/layer.py"] = old["vllm/layer.py"].replace("line 27\n", "line 27 (older)\n")
    sha = make_sdist(project.cache / "dist" / "vllm-0.9.1.tar.gz", "0.9.1", old)
    cells = matrix.classify(project, Release("0.9.1", sha))
    assert cells["0001-Core-Change-layer.patch"].pop("seconds") >= 0
    assert cells["0001-Core-Change-layer.patch"] == {"outcome": "3way", "files": ["vllm/layer.py"]}
