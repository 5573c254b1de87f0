"""What apply, check and the matrix report holds where a user would check it.

Issue #15 items 3, 7, 8 and 9: upstream detection never mistakes a conflict
for an applied change; notes pair with patches by name; "applies alone" is
decided in a clone with only the base's objects, as a fork would cherry-pick;
and no background ``git gc`` outlives a harness command.
"""

from __future__ import annotations

import hashlib
import subprocess

import pytest

from harness import __main__ as cli
from harness import matrix, series
from harness.project import HarnessError, Project, Release, git
from tests.conftest import FILES, make_sdist


def _notes(project: Project, entries: list[tuple[str, list[int]]]) -> None:
    (project.patches / "notes.toml").write_text(
        "".join(
            f'[[commit]]\npatch = "{name}"\nwhy = "w"\nupstream = "unmerged"\n'
            f"requires = {requires}\n\n"
            for name, requires in entries
        )
    )


def _check(project: Project, monkeypatch: pytest.MonkeyPatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(Project, "discover", classmethod(lambda cls, *a, **k: project))
    code = cli.main(["check"])
    return code, capsys.readouterr().out


def _helper_pair(project, commit):
    commit("[Core] Add helper", {"vllm/helper.py": "def f():\n    return 1\n"})
    commit("[Core] Use helper", {"vllm/helper.py": "def f():\n    return 2\n"})
    return series.export(project)


# --------------------------------------------------------------------------- item 3


def test_a_patch_listed_before_its_prerequisite_is_not_upstream(project, commit):
    first, second = _helper_pair(project, commit)
    (project.patches / "series").write_text(f"{second.name}\n{first.name}\n")
    with pytest.raises(HarnessError) as err:
        series.apply(project)
    assert f"{second.name} does not apply" in str(err.value)
    assert "upstream" not in str(err.value)


def test_an_upstream_delete_of_a_touched_file_is_a_rebase(project, commit):
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 5\n", "line five\n")
    commit("[Core] Change layer", {"vllm/layer.py": layer})
    (patch,) = series.export(project)
    _notes(project, [(patch.name, [])])
    older = {k: v for k, v in FILES.items() if k != "vllm/layer.py"}
    sha = make_sdist(project.cache / "dist" / "vllm-0.9.0.tar.gz", "0.9.0", older)
    cells = matrix.classify(project, Release("0.9.0", sha))
    assert cells[patch.name]["outcome"] == "rebase"


def test_a_change_already_in_the_tree_is_upstream(project, commit):
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 5\n", "line five\n")
    commit("[Core] Change layer", {"vllm/layer.py": layer})
    (patch,) = series.export(project)
    _notes(project, [(patch.name, [])])
    newer = dict(FILES, **{"vllm/layer.py": layer})
    sha = make_sdist(project.cache / "dist" / "vllm-1.1.0.tar.gz", "1.1.0", newer)
    cells = matrix.classify(project, Release("1.1.0", sha))
    assert cells[patch.name]["outcome"] == "upstream"


# --------------------------------------------------------------------------- item 7


def test_notes_pair_with_patches_by_name(project, commit, monkeypatch, capsys):
    first, second = _helper_pair(project, commit)
    _notes(project, [(second.name, [1]), (first.name, [])])  # reordered by hand
    code, out = _check(project, monkeypatch, capsys)
    assert code == 0, out


# --------------------------------------------------------------------------- item 8


def _wording_dependency(project, commit):
    """0003 needs 0002's wording in its context, but its note claims base + 0001 only."""
    layer = (project.tree / "vllm/layer.py").read_text()
    layer = layer.replace("line 5\n", "line five\n")
    commit("[Core] First", {"vllm/layer.py": layer})
    layer = layer.replace("line 20\n", "line twenty\n")
    commit("[Core] Reword", {"vllm/layer.py": layer})
    layer = layer.replace("line 22\n", "line 22\nline 22.5\n")
    commit("[Core] Insert", {"vllm/layer.py": layer})
    written = series.export(project)
    _notes(project, [(written[0].name, []), (written[1].name, [1]), (written[2].name, [1])])
    return written


def test_standalone_claim_is_checked_without_the_series_blobs(project, commit, monkeypatch, capsys):
    written = _wording_dependency(project, commit)
    code, out = _check(project, monkeypatch, capsys)
    assert code == 1
    assert f"{written[2].name} does not apply alone" in out and "base + 0001" in out
    assert f"{written[1].name} does not apply alone" not in out


def test_matrix_three_way_needs_blobs_a_fork_has(project, commit):
    written = _wording_dependency(project, commit)
    cells = matrix.classify(project, project.pin.release)
    assert cells[written[2].name].pop("seconds") >= 0
    assert cells[written[2].name] == {"outcome": "rebase", "files": ["vllm/layer.py"]}
    assert cells[written[1].name]["outcome"] == "clean"


# --------------------------------------------------------------------------- item 9


def test_apply_leaves_no_gc_behind(project, commit, tmp_path):
    commit("[Core] Change value", {"vllm/__init__.py": "VALUE = 2\n"})
    series.export(project)
    # `gc --auto` estimates loose objects from the ones in objects/17/: a few
    # there exceed the tree's (low) threshold, and a foreground gc would have
    # packed them by the time apply returns.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    chosen = [
        text
        for text in (f"blob {i}\n" for i in range(5000))
        if hashlib.sha1(f"blob {len(text)}\0{text}".encode()).hexdigest().startswith("17")
    ][:3]
    for i, text in enumerate(chosen):
        (blobs / str(i)).write_text(text)
    subprocess.run(
        ["git", "-C", str(project.tree), "hash-object", "-w", *map(str, sorted(blobs.iterdir()))],
        capture_output=True, check=True,
    )  # fmt: skip
    git(project.tree, "config", "gc.auto", "100")
    git(project.tree, "config", "gc.autoDetach", "false")
    series.apply(project)
    counts = dict(
        line.split(": ") for line in git(project.tree, "count-objects", "-v").stdout.splitlines()
    )
    assert counts["packs"] == "0" and int(counts["count"]) > 0
