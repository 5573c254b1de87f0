"""No commit or patch is lost through the harness's own commands, or through its hints.

Each test walks a path a new user takes (a stopped apply, a pull that changed
a patch, a hint followed to the letter, a submission export) and checks what
is left in the tree and in ``patches/`` afterwards.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest

from harness import series
from harness.project import HarnessError, Identity, Project, git
from tests.conftest import IDENTITY


def _unnumbered(patch: bytes) -> bytes:
    return re.sub(rb"(?m)^Subject: \[PATCH[^\]]*\]", b"Subject: [PATCH]", patch)


def _names(project: Project) -> list[str]:
    return [p.name for p in sorted(project.patches.glob("0*.patch"))]


def _listing(project: Project) -> list[str]:
    text = (project.patches / "series").read_text()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def _three(project, commit):
    commit("[Core] Change value", {"vllm/__init__.py": "VALUE = 2\n"})
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 20\n", "line twenty\n")
    commit("[Core] Change layer", {"vllm/layer.py": layer})
    commit("[Core] Add extra", {"vllm/extra.py": "EXTRA = 1\n"})
    return series.export(project)


def _stop_at_second(project, commit, tmp_path):
    """A three-patch series whose second patch no longer applies after the first."""
    written = _three(project, commit)
    saved = tmp_path / "saved"
    saved.mkdir()
    for p in written[1:]:
        shutil.copy(p, saved / p.name)
    series.reset(project)
    # A new version of 0001 that also rewrites the line next to 0002's hunk.
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 19\n", "line nineteen\n")
    commit("[Core] Change value", {"vllm/__init__.py": "VALUE = 2\n", "vllm/layer.py": layer})
    (first,) = series.format_patches(project.tree, project.pin.base_commit, tmp_path / "new")
    shutil.copy(first, project.patches / first.name)
    for p in saved.iterdir():
        shutil.copy(p, project.patches / p.name)
    names = [written[0].name, *(p.name for p in written[1:])]
    (project.patches / "series").write_text("".join(f"{n}\n" for n in names))
    with pytest.raises(HarnessError, match="does not apply"):
        series.apply(project)
    return names


def _resolve(project):
    layer = "".join(f"line {i}\n" for i in range(40))
    layer = layer.replace("line 19\n", "line nineteen\n").replace("line 20\n", "line twenty\n")
    (project.tree / "vllm/layer.py").write_text(layer)
    git(project.tree, "add", "vllm/layer.py")


def _committer_env():
    return {"GIT_COMMITTER_NAME": IDENTITY.name, "GIT_COMMITTER_EMAIL": IDENTITY.email}


# --------------------------------------------------------------------------- item 1


def test_export_after_a_hand_continued_stop_refuses_and_names_the_rest(project, commit, tmp_path):
    names = _stop_at_second(project, commit, tmp_path)
    before = {n: (project.patches / n).read_bytes() for n in names}
    _resolve(project)
    git(project.tree, "am", "--continue", env=_committer_env())  # what git itself advises
    with pytest.raises(HarnessError, match="apply --continue"):
        series.apply(project)  # apply over it would drop the resolution: it says what to run
    with pytest.raises(HarnessError) as err:
        series.export(project)
    assert names[2] in str(err.value) and "apply --continue" in str(err.value)
    assert {n: (project.patches / n).read_bytes() for n in names} == before
    assert _listing(project) == names
    # The advised command applies the rest; export then keeps all three.
    series.continue_apply(project)
    assert (project.tree / "vllm/extra.py").exists()
    assert [p.name for p in series.export(project)] == names
    assert _listing(project) == names


def test_apply_continue_finishes_the_stopped_am_and_applies_the_rest(project, commit, tmp_path):
    names = _stop_at_second(project, commit, tmp_path)
    _resolve(project)
    results = series.continue_apply(project)
    assert [r.patch for r in results] == [names[2]]
    log = git(project.tree, "log", "--format=%ad %cd %cn", "--date=raw", "-3").stdout.splitlines()
    for line in log:  # pinned committer, commit date = author date: ids are machine-free
        author_date, zone, commit_date, zone2, *name = line.split()
        assert (author_date, zone) == (commit_date, zone2)
        assert " ".join(name) == IDENTITY.name
    assert [p.name for p in series.export(project)] == names


def test_apply_continue_without_a_stop_is_refused(project, commit):
    _three(project, commit)
    series.apply(project)
    with pytest.raises(HarnessError, match="nothing to continue"):
        series.continue_apply(project)


# --------------------------------------------------------------------------- item 2


def _pull_changes_second_patch(project, tmp_path) -> bytes:
    """Someone else's work area changes 0002 and exports into the same patches/ (a pull)."""
    other = Project(root=project.root, cache=project.cache, work=tmp_path / "other")
    series.apply(other)
    git(other.tree, "checkout", "-q", "HEAD~1")
    layer = (other.tree / "vllm/layer.py").read_text().replace("line twenty", "line 20 (pulled)")
    (other.tree / "vllm/layer.py").write_text(layer)
    git(other.tree, "commit", "-q", "--amend", "-a", "--no-edit", env=IDENTITY.env())
    top = git(other.tree, "rev-parse", "HEAD").stdout.strip()
    git(other.tree, "checkout", "-q", "series")
    git(other.tree, "rebase", "-q", "--onto", top, "HEAD~1", env=IDENTITY.env())
    written = series.export(other)
    return written[1].read_bytes()


def test_export_after_a_pull_changed_a_patch_refuses_and_apply_takes_the_pull(
    project, commit, tmp_path
):
    _three(project, commit)
    series.apply(project)
    pulled = _pull_changes_second_patch(project, tmp_path)
    second = _listing(project)[1]
    with pytest.raises(HarnessError, match="changed since the last apply"):
        series.export(project)
    assert (project.patches / second).read_bytes() == pulled
    old_head = git(project.tree, "rev-parse", "HEAD").stdout.strip()
    series.apply(project)  # the tree held nothing else: it is rebuilt from the pull
    kept = git(project.tree, "rev-parse", "refs/harness/before-apply").stdout.strip()
    assert kept == old_head  # and what it held stays reachable
    assert "line 20 (pulled)" in (project.tree / "vllm/layer.py").read_text()
    series.export(project)
    assert (project.patches / second).read_bytes() == pulled


def test_commits_and_a_pull_both_follow_the_hints(project, commit, tmp_path):
    _three(project, commit)
    series.apply(project)
    mine = commit("[Core] Mine", {"vllm/mine.py": "MINE = 1\n"})
    pulled = _pull_changes_second_patch(project, tmp_path)
    with pytest.raises(HarnessError) as err:
        series.apply(project)
    message = str(err.value)
    assert "changed since the last apply" in message
    with pytest.raises(HarnessError, match="changed since the last apply"):
        series.export(project)
    # Follow the hints in the order given: save a copy, apply, cherry-pick.
    commands = re.findall(r"`([^`]+)`", message)
    for command in commands:
        if command.startswith("python -m harness apply"):
            series.apply(project)
        elif command.startswith("git "):
            subprocess.run(shlex.split(command), check=True, env={**_env(), **IDENTITY.env()})
    assert (project.tree / "vllm/mine.py").exists()
    assert "line 20 (pulled)" in (project.tree / "vllm/layer.py").read_text()
    written = series.export(project)
    assert _unnumbered(written[1].read_bytes()) == _unnumbered(pulled) and len(written) == 4
    assert git(project.tree, "cat-file", "-t", mine).stdout.strip() == "commit"


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


# --------------------------------------------------------------------------- item 4


def test_the_set_aside_hint_leads_out(project, commit):
    _three(project, commit)
    series.apply(project)
    mine = commit("[Core] Not exported", {"vllm/mine.py": "MINE = 1\n"})
    with pytest.raises(HarnessError) as err:
        series.apply(project)
    (hint,) = [c for c in re.findall(r"`([^`]+)`", str(err.value)) if " branch " in c]
    subprocess.run(shlex.split(hint), check=True, env=_env())
    series.apply(project)  # the commit is safe on the other branch now
    series.reset(project)
    assert git(project.tree, "branch", "--contains", mine).stdout.strip().endswith("series-saved")
    assert git(project.tree, "symbolic-ref", "--short", "HEAD").stdout.strip() == "series"


def test_another_branch_checked_out_names_a_command_that_works(project, commit):
    _three(project, commit)
    series.apply(project)
    git(project.tree, "branch", "-m", "series-elsewhere")
    with pytest.raises(HarnessError) as err:
        series.apply(project)
    (hint,) = re.findall(r"`(git [^`]+)`", str(err.value))
    subprocess.run(shlex.split(hint), check=True, env=_env())
    assert [r.outcome.value for r in series.apply(project)] == ["clean"] * 3


# --------------------------------------------------------------------------- item 5

SUBMITTER = Identity("Jane Submitter", "jane@example.invalid", "")


def test_submission_export_never_writes_into_patches(project, commit):
    _three(project, commit)
    before = {n: (project.patches / n).read_bytes() for n in _names(project)}
    with pytest.raises(HarnessError, match="patches/"):
        series.export(project, signoff=SUBMITTER, out=project.patches)
    assert {n: (project.patches / n).read_bytes() for n in _names(project)} == before


def test_submission_export_has_the_submitter_no_stale_files_and_no_synthetic_base(
    project, commit, tmp_path
):
    _three(project, commit)
    out = tmp_path / "submit"
    out.mkdir()
    (out / "0009-Old-version.patch").write_text("stale\n")
    written = series.export(project, signoff=SUBMITTER, author=SUBMITTER, out=out)
    assert sorted(p.name for p in out.iterdir() if p.name != "series") == sorted(
        p.name for p in written
    )
    assert not (out / "0009-Old-version.patch").exists()
    texts = [p.read_text() for p in written]
    assert all(project.pin.base_commit not in t for t in texts)
    for text in texts[1:]:
        assert "From: Jane Submitter <jane@example.invalid>" in text
        assert IDENTITY.email not in text.split("\n\n", 1)[0]
        assert "Signed-off-by: Jane Submitter <jane@example.invalid>" in text
    cover = out / "0000-cover-letter.patch"
    assert cover in written and "tag v1.0.0" in cover.read_text()
    assert "Jane Submitter (3):" in cover.read_text()


def test_submission_export_uses_the_release_commit_when_the_sdist_has_it(
    project, commit, tmp_path, monkeypatch
):
    _three(project, commit)
    upstream = "4ba787ec9" + "0" * 31
    monkeypatch.setattr(series, "upstream_base", lambda project, tree: upstream)
    written = series.export(project, signoff=SUBMITTER, out=tmp_path / "submit")
    assert f"base-commit: {upstream}" in "".join(p.read_text() for p in written)


def test_submission_export_refuses_a_folder_with_other_files(project, commit, tmp_path):
    _three(project, commit)
    out = tmp_path / "submit"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(HarnessError, match=r"notes\.txt"):
        series.export(project, signoff=SUBMITTER, out=out)
    assert (out / "notes.txt").read_text() == "mine\n"


# --------------------------------------------------------------------------- export refusals


def test_export_refuses_to_drop_a_listed_patch(project, commit):
    names = [p.name for p in _three(project, commit)]
    series.apply(project)
    git(project.tree, "reset", "-q", "--hard", "HEAD~1")
    with pytest.raises(HarnessError, match=names[2]):
        series.export(project)
    assert _listing(project) == names
    series.export(project, force=True)  # told to: the patch goes
    assert _listing(project) == names[:2]


def test_export_keeps_a_renamed_commit_without_force(project, commit):
    _three(project, commit)
    series.apply(project)
    git(project.tree, "commit", "-q", "--amend", "-m", "[Core] Add an extra module",
        env=IDENTITY.env())  # fmt: skip
    assert _listing(project)[2] == "0003-Core-Add-extra.patch"
    series.export(project)
    assert _listing(project)[2] == "0003-Core-Add-an-extra-module.patch"


def test_export_refuses_uncommitted_patch_changes_it_did_not_make(project, commit):
    _three(project, commit)
    git(project.root, "init", "-q")
    git(project.root, "add", "-A")
    git(project.root, "commit", "-q", "-m", "patches", env=IDENTITY.env())
    # No record of an apply in this tree (made before the harness kept one).
    for record in (project.tree / ".git").glob("harness-*.json"):
        record.unlink()
    edited = project.patches / _listing(project)[0]
    edited.write_text(edited.read_text().replace("Why it matters.", "Why it matters a lot."))
    with pytest.raises(HarnessError, match=edited.name):
        series.export(project)
    assert "a lot" in edited.read_text()


def test_an_unexported_commit_is_named_with_export_as_the_safe_fix(project, commit):
    _three(project, commit)
    series.apply(project)
    commit("[Core] Mine", {"vllm/mine.py": "MINE = 1\n"})
    with pytest.raises(HarnessError) as err:
        series.apply(project)
    assert "1 commit(s) that are not in patches/" in str(err.value)
    assert "unchanged since the last apply" in str(err.value)
    assert len(series.export(project)) == 4  # the fix it names loses nothing


def test_reset_gets_out_of_a_renamed_series_branch(project, commit):
    _three(project, commit)
    series.apply(project)
    mine = commit("[Core] Not exported", {"vllm/mine.py": "MINE = 1\n"})
    git(project.tree, "branch", "-m", "series-saved")  # the hint older harnesses gave
    series.reset(project)
    assert git(project.tree, "symbolic-ref", "--short", "HEAD").stdout.strip() == "series"
    assert git(project.tree, "rev-parse", "HEAD").stdout.strip() == project.pin.base_commit
    assert git(project.tree, "rev-parse", "series-saved").stdout.strip() == mine
    series.apply(project)
