"""The CI workflow a fork can run stays true to the repository.

No runner executes ``.github/workflows/series.yml`` here, so this test keeps
it honest: its releases are ``patches/base.toml``'s, every command it runs is
a nox session of ``noxfile.py`` (with arguments the harness accepts) or the
tool install of ``.ci/run``, the downloads it caches are the ones the harness
and uv use, and the releases allowed to fail are those the committed revision
matrix says the series does not apply to. Read with a few regular
expressions, not a YAML library: the harness session has none, and the file
is kept in the plain form they read.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest

from harness import __main__ as cli
from harness.project import REPO, Pin

WORKFLOW = REPO / ".github" / "workflows" / "series.yml"


def _text() -> str:
    return WORKFLOW.read_text()


def _nox_sessions() -> tuple[set[str], list[str]]:
    """Session names of noxfile.py and its default list, read from its source."""
    tree = ast.parse((REPO / "noxfile.py").read_text())
    names = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any("session" in ast.unparse(d) for d in node.decorator_list)
    }
    defaults: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions":
            defaults = ast.literal_eval(node.value)
    return names, defaults


def _runs() -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"(?m)^\s*(?:- )?run: (.+)$", _text())]


def test_the_release_list_is_base_toml_s() -> None:
    listed = re.findall(r"(?m)^\s*vllm: (\[.*\])\s*$", _text())
    assert len(listed) == 1, "one release list, in JSON flow style"
    pin = Pin.load(REPO / "patches" / "base.toml")
    assert json.loads(listed[0]) == [r.version for r in pin.releases]
    assert f"name: nox (vLLM {pin.default.version})" in _text()


def test_every_command_exists() -> None:
    sessions, defaults = _nox_sessions()
    install = (REPO / ".ci" / "run").read_text()
    runs = _runs()
    assert runs, "the workflow runs nothing"
    for command in runs:
        argv = shlex.split(command)
        if argv[:4] == ["python3", "-m", "pip", "install"]:
            for requirement in argv[4:]:
                assert f'"{requirement}"' in install, f"{requirement} differs from .ci/run"
            continue
        assert argv[0] == "nox", f"not a nox session: {command}"
        if argv == ["nox"]:
            assert set(defaults) <= sessions and defaults
            continue
        assert argv[1] == "-s", command
        rest = argv[2:]
        posargs = rest[rest.index("--") + 1 :] if "--" in rest else []
        named = rest[: rest.index("--")] if "--" in rest else rest
        assert named and set(named) <= sessions, f"unknown session in {command}"
        for session in named:
            if posargs and session in ("matrix", "pin"):
                # the session passes its posargs to `python -m harness <session>`
                assert cli.parse([session, *posargs]).command == session


def test_the_release_is_selected_the_way_the_harness_reads_it() -> None:
    from harness.project import RELEASE_ENV

    assert f"{RELEASE_ENV}: ${{{{ matrix.vllm }}}}" in _text()


@pytest.mark.parametrize("variable", ["VLLM_SERIES_CACHE", "UV_CACHE_DIR"])
def test_the_caches_it_keeps_are_the_ones_in_use(variable: str) -> None:
    text = _text()
    value = re.search(rf"(?m)^  {variable}: (.+)$", text)
    assert value, f"{variable} is not set for every job"
    paths = re.findall(r"(?ms)uses: actions/cache@\S+\n\s+with:\n\s+path: \|\n(.*?)\n\s+key:", text)
    assert paths and all(value.group(1).strip() in block for block in paths)


def test_the_releases_allowed_to_fail_are_those_the_series_does_not_apply_to() -> None:
    allowed = re.search(r"continue-on-error: .*fromJSON\('(\[.*?\])'\)", _text())
    assert allowed
    record = json.loads((REPO / "results" / "matrix.json").read_text())["data"]
    incomplete = [
        v
        for v in record["versions"]
        # a patch a backport series lacks ("absent") is not one that fails to apply
        if any(
            row["cells"][v]["outcome"] not in ("clean", "3way", "absent") for row in record["rows"]
        )
    ]
    assert json.loads(allowed.group(1)) == incomplete


def test_no_host_names_in_the_workflow() -> None:
    # Only the actions it uses are named; downloads go through the harness.
    assert not re.search(r"https?://", _text())
    assert Path(WORKFLOW).exists()
