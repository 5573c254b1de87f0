"""The command line: pytest arguments pass through; range-diff compares series versions."""

from __future__ import annotations

import pytest

from harness import __main__ as cli
from harness import series, test
from harness.project import Project, git
from tests.conftest import IDENTITY


@pytest.mark.parametrize("command", ["test", "selftest"])
@pytest.mark.parametrize(
    "argv",
    [["-k", "x"], ["--", "-k", "x"], ["-k", "x", "--", "-x"]],
    ids=["plain", "dashes", "mix"],
)
def test_every_argument_after_test_goes_to_pytest(command, argv, monkeypatch, tmp_path):
    seen: list[list[str]] = []

    def fake_tests(project, pytest_args):
        seen.append(list(pytest_args))
        return test.TestReport((), 1, 0, 0, (), "none")

    def fake_selftest(project, pytest_args):
        seen.append(list(pytest_args))
        return 0

    from harness import selftest

    monkeypatch.setattr(test, "run_tests", fake_tests)
    monkeypatch.setattr(selftest, "run", fake_selftest)
    assert cli.main([command, *argv]) == 0
    expected = argv[1:] if argv[0] == "--" else argv
    assert seen == [expected]


def test_help_still_works_after_test(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["test", "--help"])
    assert done.value.code == 0 and "pytest" in capsys.readouterr().out


def test_range_diff_shows_a_new_version_of_a_commit(project: Project, commit, monkeypatch):
    commit("[Core] First", {"vllm/__init__.py": "VALUE = 2\n"})
    layer = (project.tree / "vllm/layer.py").read_text()
    commit("[Core] Second", {"vllm/layer.py": layer.replace("line 20\n", "line twenty\n")})
    series.export(project)
    git(project.root, "init", "-q")
    git(project.root, "add", "-A")
    git(project.root, "commit", "-q", "-m", "series v1", env=IDENTITY.env())
    series.apply(project)
    (project.tree / "vllm/layer.py").write_text(layer.replace("line 20\n", "line XX\n"))
    git(project.tree, "commit", "-q", "-a", "--amend", "--no-edit", env=IDENTITY.env())
    text = series.range_diff(project)  # committed patches/ against the tree
    lines = text.splitlines()
    assert lines[0].startswith("1:  ") and " = " in lines[0] and "[Core] First" in lines[0]
    assert " ! " in lines[1] and "[Core] Second" in lines[1]
    assert "-+line twenty" in text and "++line XX" in text
    series.export(project)
    again = series.range_diff(project, "HEAD", "patches")  # committed against the new export
    assert " ! " in again.splitlines()[1]
