"""Stage 2: apply, export, check — the round trip and its guards."""

from __future__ import annotations

import shutil

import pytest

from harness import applying, checks, patches, series
from harness.project import HarnessError, git


def _standalone(project):
    base = project.pin.base_commit
    with (
        applying.base_store([(project.tree, project.pin.release.tag)]) as store,
        applying.fresh_clone(store, base) as clone,
    ):
        return checks.check_standalone(project, clone, base)


def _export_two(project, commit):
    commit("[Core] First change", {"vllm/__init__.py": "VALUE = 2\n"})
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 20\n", "line twenty\n")
    commit("[Bugfix][MoE] Second change", {"vllm/layer.py": layer, "tests/test_new.py": "x = 1\n"})
    return series.export(project)


def test_export_then_apply_round_trips_byte_for_byte(project, commit):
    written = _export_two(project, commit)
    assert [p.name for p in written] == [
        "0001-Core-First-change.patch",
        "0002-Bugfix-MoE-Second-change.patch",
    ]
    text = written[1].read_text()
    assert "Subject: [PATCH 2/2] [Bugfix][MoE] Second change" in text
    assert f"base-commit: {project.pin.base_commit}" in (written[0].read_text() + text)
    before = {p.name: p.read_bytes() for p in written}
    head = git(project.tree, "rev-parse", "HEAD").stdout

    results = series.apply(project)
    assert [r.outcome for r in results] == [applying.Outcome.CLEAN] * 2
    # am keeps [Bugfix][MoE] (--keep-non-patch) and pins the committer: same ids.
    assert git(project.tree, "log", "-1", "--format=%s").stdout.strip() == (
        "[Bugfix][MoE] Second change"
    )
    first_ids = git(project.tree, "rev-parse", "HEAD").stdout
    series.apply(project)
    assert git(project.tree, "rev-parse", "HEAD").stdout == first_ids
    series.export(project)
    assert {p.name: p.read_bytes() for p in patches.series_files(project)} == before
    base = project.pin.base_commit
    with (
        applying.base_store([(project.tree, project.pin.release.tag)]) as store,
        applying.fresh_clone(store, base) as clone,
    ):
        assert checks.check_round_trip(project, clone, base) == []
    assert head  # the original commits were replaced by identical re-applied ones


def test_commit_ids_identical_on_two_machines(project, commit, tmp_path):
    _export_two(project, commit)
    series.apply(project)
    ids = git(project.tree, "rev-list", "HEAD").stdout
    # A second "machine": a fresh work area, same pin and patches.
    project2 = type(project)(root=project.root, cache=project.cache, work=tmp_path / "w2")
    series.apply(project2)
    assert git(project2.tree, "rev-list", "HEAD").stdout == ids


def test_dirty_tree_is_refused(project, commit):
    _export_two(project, commit)
    (project.tree / "vllm/__init__.py").write_text("VALUE = 'edited'\n")
    with pytest.raises(HarnessError, match="uncommitted changes"):
        series.apply(project)
    assert (project.tree / "vllm/__init__.py").read_text() == "VALUE = 'edited'\n"


def test_unexported_commit_is_refused(project, commit):
    _export_two(project, commit)
    head = commit("[Misc] Not exported yet", {"vllm/extra.py": "y = 2\n"})
    with pytest.raises(HarnessError, match="not in patches/"):
        series.apply(project)
    assert git(project.tree, "rev-parse", "HEAD").stdout.strip() == head


def test_patch_that_no_longer_applies_names_file_and_hunk(project, commit, tmp_path):
    written = _export_two(project, commit)
    kept = tmp_path / written[1].name
    shutil.copy(written[1], kept)
    series.reset(project)
    # Upstream moved on: the context of the second patch's hunk is gone.
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 19\n", "changed upstream\n")
    commit("[Upstream] Drift", {"vllm/layer.py": layer})
    (drift,) = series.export(project, force=True)
    series.reset(project)
    shutil.copy(kept, project.patches / kept.name)
    (project.patches / "series").write_text(f"{drift.name}\n{kept.name}\n")
    with pytest.raises(HarnessError) as err:
        series.apply(project)
    message = str(err.value)
    assert f"{kept.name} does not apply" in message
    assert "files: vllm/layer.py" in message
    assert "@@ -" in message and "+line twenty" in message
    assert "python -m harness reset" in message
    series.reset(project)  # the one documented command returns to the base
    assert git(project.tree, "rev-parse", "HEAD").stdout.strip() == project.pin.base_commit
    assert git(project.tree, "status", "--porcelain").stdout == ""


def test_patch_already_upstream_is_not_success(project, commit):
    written = _export_two(project, commit)
    saved = project.root / "saved"
    saved.mkdir()
    for p in written:
        shutil.copy(p, saved / p.name)
    # A base that already contains patch 0001's change: apply it, then offer it again.
    series.apply(project)
    result = applying.apply_patch(
        project.tree, saved / written[0].name, project.pin.identity, abort=True
    )
    assert result.outcome is applying.Outcome.UPSTREAM


def test_standalone_check_uses_the_notes(project, commit):
    _export_two(project, commit)
    (project.patches / "notes.toml").write_text(
        '[[commit]]\npatch = "0001-Core-First-change.patch"\nwhy = "a"\nupstream = "unmerged"\n\n'
        '[[commit]]\npatch = "0002-Bugfix-MoE-Second-change.patch"\nwhy = "b"\n'
        'upstream = "unmerged"\nrequires = []\n'
    )
    assert _standalone(project) == []


def test_standalone_check_reports_a_hidden_dependency(project, commit):
    commit("[Core] Add helper", {"vllm/helper.py": "def f():\n    return 1\n"})
    commit("[Core] Use helper", {"vllm/helper.py": "def f():\n    return 2\n"})
    series.export(project)
    (project.patches / "notes.toml").write_text(
        '[[commit]]\npatch = "0001-Core-Add-helper.patch"\nwhy = "a"\nupstream = "unmerged"\n\n'
        '[[commit]]\npatch = "0002-Core-Use-helper.patch"\nwhy = "b"\nupstream = "unmerged"\n'
    )
    problems = _standalone(project)
    assert len(problems) == 1 and "0002-Core-Use-helper.patch" in problems[0]
