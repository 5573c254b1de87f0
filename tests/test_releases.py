"""Running the pipeline on another pinned release: its pins, its own work area, nothing shared.

Offline: the real ``patches/base.toml`` is only read, and the second release
of the synthetic project is a tarball made here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import __main__ as cli
from harness import build, series
from harness.project import RELEASE_ENV, RELEASE_KEYS, REPO, HarnessError, Pin, Project, git
from tests.conftest import FILES, pin_release

REAL_PIN = REPO / "patches" / "base.toml"


def test_each_pinned_release_selects_its_own_sdist_wheel_and_torch() -> None:
    default = Pin.load(REAL_PIN)
    assert default.is_default and default.release == default.default
    seen_wheels = {default.wheel_sha256}
    for release in default.matrix:
        pin = Pin.load(REAL_PIN, release.version)
        assert pin.release == release and not pin.is_default
        assert pin.default == default.release
        assert pin.wheel == f"vllm-{release.version}-cp38-abi3-manylinux_2_28_x86_64.whl"
        assert pin.base_commit != default.base_commit
        assert pin.wheel_sha256 not in seen_wheels
        seen_wheels.add(pin.wheel_sha256)
        # identity and Python are the series', not the release's
        assert (pin.identity, pin.python) == (default.identity, default.python)
    assert Pin.load(REAL_PIN, "0.32.0").torch == "2.13.0"
    assert Pin.load(REAL_PIN, default.release.version) == default


def test_an_unpinned_release_is_refused_with_the_pinned_ones() -> None:
    with pytest.raises(HarnessError, match=r"0\.29\.0 is not pinned.*0\.32\.0, 0\.33\.0"):
        Pin.load(REAL_PIN, "0.29.0")


def test_a_release_pinned_for_the_matrix_only_cannot_run_the_pipeline(tmp_path: Path) -> None:
    text = REAL_PIN.read_text() + '\n[[matrix]]\nversion = "0.29.0"\nsdist_sha256 = "00"\n'
    (tmp_path / "base.toml").write_text(text)
    assert Pin.load(tmp_path / "base.toml").matrix[-1].version == "0.29.0"
    with pytest.raises(HarnessError, match="lacks " + ", ".join(RELEASE_KEYS)):
        Pin.load(tmp_path / "base.toml", "0.29.0")


def test_the_release_variable_selects_a_separate_work_area(tmp_path: Path) -> None:
    env = {"VLLM_SERIES_WORK": str(tmp_path / "w"), "VLLM_SERIES_CACHE": str(tmp_path / "c")}
    default = Project.discover(env=env)
    other = Project.discover(env={**env, RELEASE_ENV: "0.32.0"})
    assert default.work == tmp_path / "w" and default.on_default
    assert other.work == tmp_path / "w" / "releases" / "0.32.0" and not other.on_default
    assert other.cache == default.cache  # downloads are shared; trees, venvs, wheels are not
    assert other.tree != default.tree and not other.tree.is_relative_to(default.tree)
    assert other.pin.release.version == "0.32.0"
    # Naming the default release is the same as naming none.
    assert Project.discover(env={**env, RELEASE_ENV: default.pin.release.version}) == default
    # for_release from a release project goes back to the same root.
    assert other.for_release("0.31.0").work == tmp_path / "w" / "releases" / "0.31.0"
    assert default.for_release(default.pin.release.version).work.name == default.pin.release.version


def _second_release(project: Project) -> Project:
    """Pin release 0.9.0 (layer.py three lines longer at the top) beside the fixture's base."""
    old = dict(FILES)
    old["vllm/layer.py"] = "# older\n# header\n# lines\n" + FILES["vllm/layer.py"]
    return pin_release(project, "0.9.0", old)


def test_apply_on_another_release_leaves_the_default_tree_alone(project, commit) -> None:
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 20\n", "line twenty\n")
    commit("[Core] Change layer", {"vllm/layer.py": layer})
    series.export(project)
    head = git(project.tree, "rev-parse", "HEAD").stdout
    release = _second_release(project)
    applied = series.apply(release)
    assert [r.outcome.value for r in applied] == ["clean"]
    assert git(project.tree, "rev-parse", "HEAD").stdout == head
    tree, base_commit = series.prepare(release)
    assert base_commit == release.pin.base_commit != project.pin.base_commit
    assert "line twenty" in (tree / "vllm/layer.py").read_text()
    # Other blob ids and line numbers than patches/ has: still the exported series.
    series.ensure_exported(release, tree, base_commit)
    # A commit of its own on that release is still caught.
    (tree / "vllm/__init__.py").write_text("VALUE = 3\n")
    git(tree, "commit", "-q", "-a", "-m", "mine", env=release.pin.identity.env())
    with pytest.raises(HarnessError, match="not in patches/"):
        series.ensure_exported(release, tree, base_commit)


@pytest.mark.parametrize("command", ["export", "check", "doc", "matrix"])
def test_commands_of_the_default_release_refuse_another(command, monkeypatch, capsys) -> None:
    monkeypatch.setenv(RELEASE_ENV, "0.32.0")
    assert cli.main([command]) == 2
    assert f"{RELEASE_ENV}=0.32.0" in capsys.readouterr().err


def test_an_unknown_release_is_an_error_not_a_traceback(monkeypatch, capsys) -> None:
    monkeypatch.setenv(RELEASE_ENV, "9.9.9")
    assert cli.main(["apply"]) == 2
    assert "9.9.9 is not pinned" in capsys.readouterr().err


def test_the_tree_must_build_with_the_pinned_torch() -> None:
    build.check_torch_pin(["cmake>=3.26.1", "torch==2.13.0"], "2.13.0", "0.32.0")
    expected = re.escape("torch 2.14.0, but patches/base.toml pins torch 2.13.0")
    with pytest.raises(HarnessError, match=expected):
        build.check_torch_pin(["torch==2.14.0"], "2.13.0", "0.32.0")


def test_every_deselected_test_is_a_series_test_with_a_reason() -> None:
    """A release's deselect list names tests the series really has, each with a reason."""
    from harness.patches import patch_tests

    project = Project.discover(env={})
    patches = list((REPO / "patches").glob("[0-9][0-9][0-9][0-9]-*.patch"))
    for release in project.pin.releases:
        for test_id, why in Pin.load(REAL_PIN, release.version).deselect:
            file, _, name = test_id.partition("::")
            owners = [p for p in patches if file in patch_tests(p)]
            assert owners, f"{test_id}: no patch adds or changes {file}"
            assert any(f"+def {name}(" in p.read_text() for p in owners), test_id
            assert len(why) > 20
    assert Pin.load(REAL_PIN).deselect == ()  # the base release runs every test


def test_deselected_tests_are_reported_per_cell(tmp_path: Path) -> None:
    from harness import matrix, test

    patch = tmp_path / "0001-a.patch"
    patch.write_text("diff --git a/tests/x/test_a.py b/tests/x/test_a.py\n")
    case = test.Case("tests/x/test_a.py", "tests/x/test_a.py::test_one", "passed", 1.0)
    cells = matrix.cell_tests([patch], [case], ["tests/x/test_a.py::test_two"])
    assert (
        cells["0001-a.patch"]["detail"] == "1 passed, 0 skipped, 1 deselected (patches/base.toml)"
    )
    report = test.TestReport((), 1, 0, 0, (), "none", (("tests/x/test_a.py::test_two", "why"),))
    assert "1 deselected" in report.summary() and report.ok
