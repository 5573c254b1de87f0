"""SERIES.md and results/README.md: generated blocks and the claims table."""

from __future__ import annotations

import json

import pytest

from harness import device_run, document, patches, results, series
from harness.project import HarnessError


def test_series_md_blocks_follow_patches_and_notes(project, commit):
    commit("[Core] First", {"vllm/__init__.py": "VALUE = 2\n", "tests/x/test_first.py": "a = 1\n"})
    series.export(project)
    (project.patches / "notes.toml").write_text(
        '[[commit]]\npatch = "0001-Core-First.patch"\nwhy = "Because."\n'
        'upstream = "unmerged"\nevidence = ["results/x.json"]\n'
    )
    (project.root / "SERIES.md").write_text(
        "intro\n<!-- BEGIN GENERATED: header -->\n<!-- END GENERATED: header -->\n"
        "<!-- BEGIN GENERATED: commits -->\nold\n<!-- END GENERATED: commits -->\nouttro\n"
    )
    assert document.stale(project) == ["SERIES.md"]
    assert document.update(project) == ["SERIES.md"]
    text = (project.root / "SERIES.md").read_text()
    assert text.startswith("intro\n") and text.endswith("outtro\n")
    assert f"`{patches.series_hash(project)}` (1 patches)" in text
    assert "### 0001 [Core] First" in text and "- **Why:** Because." in text
    assert "the bare base" in text and "`tests/x/test_first.py`" in text
    assert "[results/x.json](results/x.json)" in text
    assert document.stale(project) == []


def test_notes_must_cover_the_series(project, commit):
    commit("[Core] First", {"vllm/__init__.py": "VALUE = 2\n"})
    series.export(project)
    (project.patches / "notes.toml").write_text("")
    with pytest.raises(HarnessError, match="no entry for"):
        patches.load_notes(project)


def test_result_files_carry_provenance(project, tmp_path):
    prov = {k: "x" for k in results.REQUIRED}
    path = results.write(tmp_path / "r.json", "demo", {"value": [1, 2]}, prov)
    assert results.validate(path) == []
    assert results.lookup(tmp_path, "r.json#/data/value/1") == 2
    record = json.loads(path.read_text())
    del record["provenance"]["gpu"]
    path.write_text(json.dumps(record))
    assert results.validate(path) == [f"{path}: provenance lacks gpu"]
    with pytest.raises(HarnessError, match="lacks"):
        results.write(tmp_path / "s.json", "demo", {}, {"command": "x"})
    # A bare list is refused with a message, not a crash of `harness check`.
    path.write_text("[1, 2]")
    assert results.validate(path) == [
        f"{path}: not a result record (a JSON object with schema, kind, provenance "
        "and data; write it with harness.results.write)"
    ]


def test_summaries_hold_their_rows_at_the_top_level(tmp_path):
    prov = {k: "x" for k in results.REQUIRED}
    path = tmp_path / "summary.json"
    record = {"schema": results.SCHEMA, "kind": "staging-summary", "provenance": prov}
    path.write_text(json.dumps({**record, "rows": []}))
    assert results.validate(path) == []
    path.write_text(json.dumps({**record, "data": {}}))
    assert results.validate(path) == [f"{path}: no rows"]
    path.write_text(json.dumps({**record, "kind": "e2e-summary", "decode": []}))
    assert results.validate(path) == [f"{path}: no ttft"]


def test_provenance_names_the_code_under_test(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SERIES_WORK", str(tmp_path / "work"))  # no built wheel here
    monkeypatch.delenv(device_run.BUNDLE_TREE_ENV, raising=False)
    assert "tree_commit" not in results.provenance("x")
    monkeypatch.setenv(device_run.BUNDLE_TREE_ENV, "abc123")  # as device_run.py sets it
    prov = results.provenance("x")
    assert prov["tree_commit"] == "abc123" and prov["vllm_from"] == "device bundle"
    assert "wheel_sha256" not in prov
    # The bundle's series hash, not the carried patches/'s: none for a probe's tree.
    monkeypatch.delenv(results.BUNDLE_SERIES_ENV, raising=False)
    assert results.provenance("x")["series_hash"] == results.NOT_THE_SERIES
    monkeypatch.setenv(results.BUNDLE_SERIES_ENV, "bundled")
    assert results.provenance("x")["series_hash"] == "bundled"
    monkeypatch.setattr(results, "series_hash", lambda project: "now")
    (tmp_path / "work" / "dist").mkdir(parents=True)
    build_json = tmp_path / "work" / "dist" / "build.json"
    build_json.write_text(
        json.dumps({"wheel_sha256": "w", "tree_commit": "t", "series_hash": "now"})
    )
    prov = results.provenance("x")  # a built wheel wins: it is what the harness venv runs
    assert (prov["wheel_sha256"], prov["tree_commit"]) == ("w", "t") and "vllm_from" not in prov
    assert "stale_build" not in prov


def test_provenance_names_no_wheel_built_from_another_series(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SERIES_WORK", str(tmp_path / "work"))
    monkeypatch.setattr(results, "series_hash", lambda project: "now")
    (tmp_path / "work" / "dist").mkdir(parents=True)
    (tmp_path / "work" / "dist" / "build.json").write_text(
        json.dumps({"wheel_sha256": "w", "tree_commit": "t", "series_hash": "before"})
    )
    prov = results.provenance("x")
    assert "wheel_sha256" not in prov and "tree_commit" not in prov
    assert prov["stale_build"] == "the built wheel is of series before"


def test_claims_table_reads_our_value_from_the_result(project):
    (project.root / "results").mkdir()
    prov = {k: "x" for k in results.REQUIRED}
    results.write(project.root / "results/a.json", "demo", {"ttft_s": 1.8}, prov)
    (project.root / "results/claims.toml").write_text(
        '[[claim]]\nid = "C1"\nclaim = "TTFT"\nseed = "1.81 s"\n'
        'ours_from = "results/a.json#/data/ttft_s"\nmethod = "replayed at layer level"\n'
        'command = "nox -s replay"\nfile = "results/a.json"\n\n'
        '[[claim]]\nid = "C2"\nclaim = "decode"\nseed = "107 tok/s"\n'
        'method = "runnable-by-user, not run here (no SM120)"\ncommand = "nox -s replay"\n'
    )
    with (project.root / "results/claims.toml").open("a") as fh:
        fh.write(
            '\n[[claim]]\nid = "C3"\nclaim = "two"\nseed = "s"\nmethod = "m"\ncommand = "c"\n'
            'ours_from = ["results/a.json#/data/ttft_s", "results/a.json#/kind"]\n'
            'ours_format = "{0} s ({1})"\n'
            'e2e_from = "results/a.json#/data/ttft_s"\ne2e_format = "pool {0} s"\n'
        )
    table = results.render_claims(project)
    assert "| C3: two | s | 1.8 s (demo) | pool 1.8 s | m |" in table
    assert "| C1: TTFT | 1.81 s | 1.8 |  | replayed at layer level |" in table
    assert "End to end on synthetic weights" not in table
    text = (project.root / "results/claims.toml").read_text()
    (project.root / "results/claims.toml").write_text('e2e_differs = "TP=1"\n' + text)
    assert results.render_claims(project).endswith("End to end on synthetic weights: TP=1\n")
    assert "| C2: decode | 107 tok/s | not run here |" in table
