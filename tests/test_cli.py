"""The command line: pytest arguments pass through; range-diff compares series versions."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from harness import __main__ as cli
from harness import document, kernels, series, test
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


# --- README's command table against the parser -------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"
_ROW = re.compile(r"^\| `python -m harness ([\w-]+)([^`]*)` \| (.*) \|$", re.M)


def readme_commands(text: str) -> dict[str, tuple[str, str]]:
    """README's "Harness commands" table: command -> (usage after the name, description)."""
    return {m.group(1): (m.group(2), m.group(3)) for m in _ROW.finditer(text)}


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def disagreements(text: str) -> list[str]:
    """Where README's command table and ``python -m harness --help`` disagree."""
    rows, parsers = readme_commands(text), subparsers()
    problems = [f"{name}: in the parser, not in README" for name in parsers.keys() - rows.keys()]
    problems += [f"{name}: in README, not in the parser" for name in rows.keys() - parsers.keys()]
    for name in rows.keys() & parsers.keys():
        usage = rows[name][0]
        options = {o for a in parsers[name]._actions for o in a.option_strings}
        problems += [
            f"{name}: README names {opt}, which it does not take"
            for opt in re.findall(r"--[\w-]+", usage)
            if opt not in options
        ]
        positional = [a for a in parsers[name]._actions if not a.option_strings and a.choices]
        for action in positional:
            listed = set(re.findall(r"\w+", usage.split("[")[0]))
            problems += [
                f"{name}: README does not list {choice!r}"
                for choice in action.choices
                if choice not in listed
            ]
    if "doc" in rows:
        problems += [
            f"doc: README does not name {doc}"
            for doc in document.DOCUMENTS
            if doc not in rows["doc"][1]
        ]
    if "kernels" in rows:
        names = {"nvfp4": "NVFP4", "fp8": "FP8", "gptq4": "GPTQ int4", "awq4": "AWQ int4",
                 "mxfp4": "MXFP4", "mxfp8": "MXFP8", "gptq8": "GPTQ int8"}  # fmt: skip
        for fmt in kernels.DEFAULT_FORMATS:
            label = names[fmt.split(":")[0]]
            problems += [f"kernels: {where} omits the default {label}"
                         for where, text_ in (("README", rows["kernels"][1]),
                                              ("--help", parsers["kernels"].description or ""))
                         if label not in text_]  # fmt: skip
    if "matrix" in rows:
        for outcome in ("clean", "3way", "rebase", "upstream", "blocked", "absent"):
            problems += [
                f"matrix: {where} omits {outcome!r}"
                for where, text_ in (("README", rows["matrix"][1]),
                                     ("--help", parsers["matrix"].description or ""))
                if outcome not in text_
            ]  # fmt: skip
    return problems


def test_readme_command_table_agrees_with_the_parser():
    assert disagreements(README.read_text()) == []


def test_every_subcommand_argument_has_help():
    missing = [
        f"{name} {action.dest}"
        for name, sub in subparsers().items()
        for action in sub._actions
        if not action.help and not isinstance(action, argparse._HelpAction)
    ]
    assert missing == []


@pytest.mark.parametrize(
    "edit",
    [
        ("| `python -m harness hash` |", "| `python -m harness hashes` |"),
        ("`python -m harness build [--full]", "`python -m harness build [--fast]"),
        ("ttft\\|decode\\|oom\\|plot\\|e2e", "ttft\\|decode\\|oom"),
        ("results/e2e-v0.34.0/README.md (Which flag)", "results/e2e-v0.34.0 (Which flag)"),
        ("`upstream`; `blocked`: a prerequisite fails;", "`upstream`;"),
        ("MXFP4, MXFP8)", "MXFP4)"),
    ],
    ids=["command", "option", "experiment", "doc", "matrix", "kernels"],
)
def test_a_readme_that_drifts_from_the_parser_is_caught(edit):
    text = README.read_text()
    assert edit[0] in text, edit[0]
    assert disagreements(text.replace(edit[0], edit[1])) != []
