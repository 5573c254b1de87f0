"""``matrix --test``: per release, apply, build and test; per cell, a build and a test result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import build, document, matrix, results, series, test
from harness.project import HarnessError, Project, git
from tests.conftest import FILES, make_sdist, pin_release

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_layer" name="test_a" time="1.5" />
<testcase classname="tests.test_layer.TestGroup" name="test_b" time="0.5"><skipped message="no GPU"/></testcase>
<testcase classname="tests.sub.test_other" name="test_c[x]" time="2.0"><failure message="boom"/></testcase>
<testcase classname="tests.sub.test_other" name="test_d" time="1.0"><error message="bad"/></testcase>
</testsuite></testsuites>
"""  # noqa: E501


def _patch(path: Path, tests: list[str]) -> Path:
    diffs = "".join(f"diff --git a/{t} b/{t}\n" for t in tests)
    path.write_text(f"Subject: [PATCH] x\n\n---\n{diffs}")
    return path


def test_junit_cases_name_their_test_file(tmp_path: Path) -> None:
    (tmp_path / "r.xml").write_text(JUNIT)
    cases = test.junit_cases(tmp_path / "r.xml")
    assert [(c.file, c.outcome, c.seconds) for c in cases] == [
        ("tests/test_layer.py", "passed", 1.5),
        ("tests/test_layer.py", "skipped", 0.5),
        ("tests/sub/test_other.py", "failed", 2.0),
        ("tests/sub/test_other.py", "error", 1.0),
    ]
    assert cases[2].test_id == "tests/sub/test_other.py::test_c[x]"


def test_each_cell_gets_its_own_tests_result_and_time(tmp_path: Path) -> None:
    (tmp_path / "r.xml").write_text(JUNIT)
    cases = test.junit_cases(tmp_path / "r.xml")
    patches = [
        _patch(tmp_path / "0001-a.patch", ["tests/test_layer.py"]),
        _patch(tmp_path / "0002-b.patch", ["tests/sub/test_other.py", "tests/test_layer.py"]),
        _patch(tmp_path / "0003-c.patch", []),
        _patch(tmp_path / "0004-d.patch", ["tests/test_gone.py"]),
    ]
    cells = matrix.cell_tests(patches, cases)
    assert cells["0001-a.patch"] == {"result": "passed", "detail": "1 passed, 1 skipped",
                                     "seconds": 2.0}  # fmt: skip
    assert cells["0002-b.patch"] == {
        "result": "failed", "detail": "tests/sub/test_other.py::test_c[x]", "seconds": 5.0,
    }  # fmt: skip
    assert cells["0003-c.patch"]["result"] == "no tests"
    assert cells["0004-d.patch"] == {"result": "failed", "detail": "none of its tests ran",
                                     "seconds": 0.0}  # fmt: skip


def _one_passing_test(release: Project) -> test.TestReport:
    """A stand-in for ``test.run_tests``: one passing case of tests/test_layer.py."""
    test.junit_path(release).write_text(
        '<testsuites><testsuite><testcase classname="tests.test_layer" name="test_x" '
        'time="0.25"/></testsuite></testsuites>'
    )
    return test.TestReport(("tests/test_layer.py",), 1, 0, 0, (), "none")


def _two_patches(project: Project, commit) -> None:
    commit("[Core] Change value", {"vllm/__init__.py": "VALUE = 2\n"})
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 5\n", "line five\n")
    commit(
        "[Core] Change layer",
        {"vllm/layer.py": layer, "tests/test_layer.py": "def test_x():\n    pass\n"},
    )
    series.export(project)
    (project.patches / "notes.toml").write_text(
        '[[commit]]\npatch = "0001-Core-Change-value.patch"\nwhy = "a"\nupstream = "unmerged"\n\n'
        '[[commit]]\npatch = "0002-Core-Change-layer.patch"\nwhy = "b"\nupstream = "unmerged"\n'
    )


def _two_patches_first_in_a_stack(project: Project, commit) -> None:
    """:func:`_two_patches`, the first commit's note marking it commit 1 of stack "s"."""
    _two_patches(project, commit)
    notes = project.patches / "notes.toml"
    notes.write_text(notes.read_text().replace('why = "a"\n', 'why = "a"\nstack = "s"\n'))


def test_a_release_where_the_series_stops_runs_nothing_and_says_why(project, commit) -> None:
    _two_patches(project, commit)
    old = dict(FILES)
    old["vllm/layer.py"] = old["vllm/layer.py"].replace("line 4\n", "line four\n")
    sha = make_sdist(project.cache / "dist" / "vllm-0.9.0.tar.gz", "0.9.0", old)
    pin = project.patches / "base.toml"
    pin.write_text(pin.read_text() + f'\n[[matrix]]\nversion = "0.9.0"\nsdist_sha256 = "{sha}"\n')
    from harness.project import Release

    cells = matrix.classify(project, Release("0.9.0", sha))
    assert all(c["seconds"] >= 0 for c in cells.values())
    run = matrix.run_release(project, "0.9.0", cells)
    assert run["build"] == {"result": "not run", "detail": "the series stops at 0002 on this "
                            "release", "seconds": 0.0}  # fmt: skip
    assert cells["0001-Core-Change-value.patch"]["test"]["detail"].startswith("the series stops")
    assert cells["0002-Core-Change-layer.patch"]["build"]["detail"] == "the patch did not apply"
    # no work area was made for a release that runs nothing
    assert not (project.work / "releases" / "0.9.0" / "venv").exists()


def test_a_standalone_commit_past_the_stop_is_built_and_tested_alone(
    project, commit, monkeypatch
) -> None:
    # 0001 does not apply on 0.9.0; 0002 stands on the bare base and applies alone there.
    _two_patches(project, commit)
    old = dict(FILES)
    old["vllm/__init__.py"] = "VALUE = 0\n"
    release = pin_release(project, "0.9.0", old)

    built: list[list[str]] = []

    def fake_build(release: Project, *, stock_kernels: bool) -> None:
        built.append(git(release.tree, "log", "--format=%s", "-2").stdout.split("\n")[:2])

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(test, "run_tests", _one_passing_test)
    cells = matrix.classify(project, release.pin.release)
    assert cells["0001-Core-Change-value.patch"]["outcome"] not in matrix.APPLIED
    assert cells["0002-Core-Change-layer.patch"]["outcome"] == "clean"
    run = matrix.run_release(project, "0.9.0", cells)
    assert run["build"]["detail"] == "the series stops at 0001 on this release"
    alone = run["alone"]["0002-Core-Change-layer.patch"]
    assert [alone[s]["result"] for s in ("apply", "build", "test")] == ["passed"] * 3
    # the tree that was built holds 0002 alone on the release's base
    assert built == [["[Core] Change layer", "vLLM 0.9.0 from its sdist"]]
    layer = cells["0002-Core-Change-layer.patch"]
    assert layer["build"] == {"result": "passed", "detail": "alone on the base", "seconds": 0.0}
    assert layer["test"]["result"] == "passed"
    assert cells["0001-Core-Change-value.patch"]["build"]["detail"] == "the patch did not apply"
    # The build's export check takes a tree made by apply(only=...) while it is just that,
    # and refuses it once it holds another commit.
    tree, base_commit = release.tree, release.pin.base_commit
    assert series.applied_alone(release, tree, base_commit) == ("0002-Core-Change-layer.patch",)
    series.ensure_exported(release, tree, base_commit)
    (tree / "extra.txt").write_text("x\n")
    git(tree, "add", "extra.txt")
    git(tree, "-c", "user.name=me", "-c", "user.email=me@x", "commit", "-qm", "mine")
    assert series.applied_alone(release, tree, base_commit) is None
    with pytest.raises(HarnessError, match="not in patches/"):
        series.ensure_exported(release, tree, base_commit)
    record = {
        "schema": 1,
        "kind": "revision-matrix",
        "provenance": {
            "command": "nox -s matrix -- --test",
            "date": "2026-12-01",
            "series_hash": "x",
        },
        "data": {
            "versions": ["0.9.0"],
            "runs": {"0.9.0": run},
            "rows": [{"patch": n, "cells": {"0.9.0": c}} for n, c in cells.items()],
        },
    }
    (project.results / "matrix.json").parent.mkdir(parents=True, exist_ok=True)
    (project.results / "matrix.json").write_text(json.dumps(record))
    assert matrix.failures(record["data"]) == []
    run["alone"]["0002-Core-Change-layer.patch"]["test"]["result"] = "failed"
    assert matrix.failures(record["data"]) == ["0.9.0 0002 alone test"]
    text = document.render_matrix(project)
    assert "passed (alone on the base)" in text
    assert "  - 0002 alone on the bare base: apply passed" in text


def test_a_release_where_everything_applies_runs_in_its_own_work_area(
    project, commit, monkeypatch
) -> None:
    _two_patches(project, commit)
    seen: list[Path] = []

    def fake_build(release: Project, *, stock_kernels: bool) -> None:
        assert stock_kernels
        seen.append(release.work)

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(test, "run_tests", _one_passing_test)
    default_head = (project.tree / ".git" / "HEAD").read_text()
    cells = matrix.classify(project, project.pin.release)
    run = matrix.run_release(project, project.pin.release.version, cells)
    assert [run[s]["result"] for s in ("apply", "build", "test")] == ["passed"] * 3
    assert seen == [project.work / "releases" / "1.0.0"]
    layer = cells["0002-Core-Change-layer.patch"]
    assert layer["build"]["result"] == "passed"
    assert layer["test"] == {"result": "passed", "detail": "1 passed, 0 skipped", "seconds": 0.2}
    assert cells["0001-Core-Change-value.patch"]["test"]["result"] == "no tests"
    assert (project.tree / ".git" / "HEAD").read_text() == default_head


def test_a_failed_build_stops_the_release_and_names_the_error(project, commit, monkeypatch):
    _two_patches(project, commit)

    def broken(release: Project, *, stock_kernels: bool) -> None:
        raise HarnessError("uv exited with 1; last lines of build.log:\nno compiler")

    monkeypatch.setattr(build, "build", broken)
    cells = matrix.classify(project, project.pin.release)
    run = matrix.run_release(project, project.pin.release.version, cells)
    assert run["build"]["result"] == "failed"
    assert run["build"]["detail"] == "uv exited with 1; last lines of build.log:"
    assert run["test"] == {"result": "not run", "detail": "build failed", "seconds": 0.0}
    assert cells["0001-Core-Change-value.patch"]["test"]["result"] == "not run"


def test_build_and_test_columns_render_in_series_md(project) -> None:
    (project.root / "SERIES.md").write_text(
        "<!-- BEGIN GENERATED: matrix -->\n<!-- END GENERATED: matrix -->\n"
    )
    prov = {k: "x" for k in results.REQUIRED}
    prov |= {"command": "nox -s matrix -- --test", "date": "2026-12-01T10:00:00+00:00",
             "series_hash": "abc"}  # fmt: skip
    passed = {"result": "passed", "detail": "", "seconds": 61.0}
    not_run = {"result": "not run", "detail": "the patch did not apply", "seconds": 0.0}
    data = {
        "versions": ["0.9.0", "1.0.0"],
        "rows": [{"patch": "0001-x.patch", "cells": {
            "0.9.0": {"outcome": "rebase", "files": ["a.py"], "seconds": 0.4,
                      "build": not_run, "test": not_run},
            "1.0.0": {"outcome": "clean", "files": ["a.py"], "seconds": 0.3, "build": passed,
                      "test": {"result": "failed", "detail": "tests/t.py::test_a", "seconds": 2.5}},
        }}],
        "runs": {
            "0.9.0": {s: not_run for s in ("apply", "build", "test")},
            "1.0.0": {"apply": passed, "build": passed, "test": passed},
        },
    }  # fmt: skip
    results.write(project.results / "matrix.json", "revision-matrix", data, prov)
    document.update(project)
    text = (project.root / "SERIES.md").read_text()
    assert "| patch | 0.9.0 apply | 0.9.0 build | 0.9.0 test | 1.0.0 apply |" in text
    assert (
        "| 0001-x.patch | rebase (a.py), 0.4 s | not run: the patch did not apply | not run: "
        "the patch did not apply | clean, 0.3 s | passed | failed: tests/t.py::test_a, 2.5 s |"
    ) in text
    assert "- 1.0.0: apply passed, 1 min 1 s; build passed, 1 min 1 s;" in text
    assert not document.stale(project)


@pytest.mark.parametrize("flag", [[], ["--test"]])
def test_the_matrix_command_takes_test(flag: list[str]) -> None:
    from harness import __main__ as cli

    assert cli.parse(["matrix", *flag]).test is bool(flag)


def test_each_prefix_of_a_stack_is_built_and_tested_alone_on_the_base(
    project, commit, monkeypatch
) -> None:
    _two_patches_first_in_a_stack(project, commit)
    built: list[list[str]] = []

    def fake_build(release: Project, *, stock_kernels: bool) -> None:
        built.append(git(release.tree, "log", "--format=%s", "-3").stdout.split("\n")[:-1])

    monkeypatch.setattr(build, "build", fake_build)
    monkeypatch.setattr(test, "run_tests", _one_passing_test)
    cells = matrix.classify(project, project.pin.release)
    run = matrix.run_release(project, project.pin.release.version, cells)
    # the prefix (0001 alone) first, then the whole series, which the tree is left at
    assert built == [
        ["[Core] Change value", "vLLM 1.0.0 from its sdist"],
        ["[Core] Change layer", "[Core] Change value", "vLLM 1.0.0 from its sdist"],
    ]
    prefix = run["prefixes"]["0001-Core-Change-value.patch"]
    assert [prefix[s]["result"] for s in ("apply", "build", "test")] == ["passed"] * 3
    assert prefix["own"]["result"] == "no tests"
    # the full run's cells are the full run's
    assert cells["0001-Core-Change-value.patch"]["build"]["detail"] == ""
    data = {
        "versions": ["1.0.0"],
        "runs": {"1.0.0": run},
        "rows": [{"patch": n, "cells": {"1.0.0": c}} for n, c in cells.items()],
    }
    record = {"schema": 1, "kind": "revision-matrix", "data": data,
              "provenance": {"command": "nox -s matrix -- --test", "date": "2026-12-01",
                             "series_hash": "x"}}  # fmt: skip
    (project.results / "matrix.json").parent.mkdir(parents=True, exist_ok=True)
    (project.results / "matrix.json").write_text(json.dumps(record))
    assert "  - the series up to 0001: apply passed" in document.render_matrix(project)
    assert "bare base; commit 1 of 1 of the s stack" in document.render_commits(project)
    assert matrix.failures(data) == []
    prefix["own"] = {"result": "failed", "detail": "tests/test_layer.py::test_x"}
    assert matrix.failures(data) == ["1.0.0 prefix to 0001 own"]


def test_a_prefix_without_tests_reads_no_tests_when_no_report_was_written(
    project, commit, monkeypatch
) -> None:
    # The first commit of a stack adds no test file: its prefix's test run collects
    # nothing and writes no JUnit report; its own tests are "no tests", not "not run".
    _two_patches_first_in_a_stack(project, commit)
    monkeypatch.setattr(build, "build", lambda release, *, stock_kernels: None)

    def no_report(release: Project) -> test.TestReport:
        test.junit_path(release).unlink(missing_ok=True)
        return test.TestReport((), 0, 0, 0, (), "none")

    monkeypatch.setattr(test, "run_tests", no_report)
    cells = matrix.classify(project, project.pin.release)
    run = matrix.run_release(project, project.pin.release.version, cells)
    assert run["prefixes"]["0001-Core-Change-value.patch"]["own"]["result"] == "no tests"
    # the whole series' layer commit has a test file, and no report: not run
    assert cells["0002-Core-Change-layer.patch"]["test"]["result"] == "not run"
