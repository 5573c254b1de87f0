"""Pinning a release from the index, and series folders per release (backports).

Offline: the index is a dictionary of files the test writes into the cache,
and ``fetch`` finds them there, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json

import pytest

from harness import __main__ as cli
from harness import checks, matrix, pinning, series
from harness.patches import series_hash
from harness.project import REPO, HarnessError, Pin, Project, sha256_file
from tests.conftest import FILES, make_sdist, pin_release

VERSION_PY = "__version__ = version = '2.0.0'\n__commit_id__ = commit_id = 'gabc1234de'\n"
CUDA_TXT = "-r common.txt\ntorch==2.15.0\ntorchaudio==2.12.0\nflashinfer-python==0.8.1 # pin\n"


def _release_files(project: Project, version: str) -> None:
    """An sdist with _version.py and requirements/cuda.txt, and a wheel, in the cache."""
    files = {**FILES, "vllm/_version.py": VERSION_PY, "requirements/cuda.txt": CUDA_TXT}
    make_sdist(project.cache / "dist" / f"vllm-{version}.tar.gz", version, files)
    wheel = project.cache / "dist" / f"vllm-{version}-{pinning.WHEEL_PLATFORM}.whl"
    wheel.write_bytes(b"not really a wheel")


def test_pin_derives_every_field_from_the_files_and_appends_the_entry(project: Project) -> None:
    _release_files(project, "2.0.0")
    entry = pinning.pin(project, "2.0.0")
    sdist = project.cache / "dist" / "vllm-2.0.0.tar.gz"
    assert entry["sdist_sha256"] == sha256_file(sdist)
    assert entry["wheel_sha256"] == sha256_file(sdist.with_name(entry["wheel"]))
    assert (entry["upstream_commit"], entry["torch"], entry["flashinfer"]) == (
        "abc1234de", "2.15.0", "0.8.1",
    )  # fmt: skip
    # the entry is complete: the pipeline can select the release at once
    selected = project.for_release("2.0.0")
    assert selected.pin.base_commit == entry["base_commit"] and selected.pin.torch == "2.15.0"
    # and its base commit is the one apply will make from the same sdist
    _, base = series.prepare(selected)
    assert base == entry["base_commit"]
    with pytest.raises(HarnessError, match="already pinned"):
        pinning.pin(project, "2.0.0")


def test_pin_refuses_what_it_cannot_pin(project: Project) -> None:
    with pytest.raises(HarnessError, match="not a release version"):
        pinning.pin(project, "2.0")
    with pytest.raises(HarnessError, match="patches/nope/series does not exist"):
        pinning.pin(project, "2.0.0", series="nope")
    sdist = project.cache / "dist" / "vllm-2.1.0.tar.gz"
    make_sdist(sdist, "2.1.0", {**FILES, "vllm/_version.py": VERSION_PY})
    (project.cache / "dist" / f"vllm-2.1.0-{pinning.WHEEL_PLATFORM}.whl").write_bytes(b"w")
    before = project.pin_file.read_text()
    with pytest.raises(HarnessError, match=r"no requirements/cuda\.txt"):
        pinning.pin(project, "2.1.0")
    assert project.pin_file.read_text() == before  # nothing half-written


def test_newer_releases_are_final_releases_above_every_pin(project: Project) -> None:
    files = {
        name: "" for name in (
            "vllm-0.9.0.tar.gz", "vllm-1.0.0.tar.gz", "vllm-1.0.1.tar.gz", "vllm-1.10.0.tar.gz",
            "vllm-1.1.0rc1.tar.gz", "vllm-1.2.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        )
    }  # fmt: skip
    assert pinning.newer_releases(project, files) == ["1.0.1", "1.10.0"]


def _backport(project: Project, commit, version: str = "0.9.0") -> Project:
    """The fixture's one-patch series copied to patches/<version>, pinned for ``version``."""
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 5\n", "line five\n")
    commit("[Core] Change layer", {"vllm/layer.py": layer})
    series.export(project)
    (project.patches / "notes.toml").write_text(
        "".join(
            f'[[commit]]\npatch = "{p.name}"\nwhy = "w"\nupstream = "u"\nrequires = []\n'
            for p in project.patches.glob("0*.patch")
        )
    )
    folder = project.patches / version
    folder.mkdir()
    for path in project.patches.iterdir():
        if path.is_file() and path.name != "base.toml":
            (folder / path.name).write_bytes(path.read_bytes())
    backport = pin_release(project, version, FILES, series=version)
    # made on its own release: applied there and exported into its folder
    series.apply(backport)
    series.export(backport)
    return backport


def test_a_backport_folder_is_the_series_of_its_release(project: Project, commit) -> None:
    backport = _backport(project, commit)
    assert backport.patches == project.root / "patches" / "0.9.0"
    assert backport.on_default and backport.pin.home == "0.9.0"
    assert project.patches == project.root / "patches"
    assert [b.vllm for b in project.backports()] == ["0.9.0"]
    # exported on its own base: the same change, another base commit, another hash
    assert series_hash(backport) != series_hash(project)
    assert b"line five" in next(backport.patches.glob("0*.patch")).read_bytes()


def test_export_writes_a_backport_only_on_its_own_release(project: Project) -> None:
    pin_file = project.pin_file
    text = pin_file.read_text()
    (project.patches / "0.8.0").mkdir()
    (project.patches / "0.8.0" / "series").write_text("")
    for version, series_key in (("0.7.0", "0.8.0"), ("0.8.0", "0.8.0")):
        text += (
            f'\n[[matrix]]\nversion = "{version}"\nsdist_sha256 = "0"\nupstream_commit = "0"\n'
            f'base_commit = "x"\nwheel = "w.whl"\nwheel_sha256 = "0"\ntorch = "2.13.0"\n'
            f'flashinfer = "0"\nseries = "{series_key}"\n'
        )
    pin_file.write_text(text)

    def args(command: str) -> argparse.Namespace:
        return argparse.Namespace(command=command, out=None)

    cli.refuse_off_default(project.for_release("0.8.0"), args("export"))
    with pytest.raises(HarnessError, match=r"made on vLLM 0\.8\.0.*VLLM_SERIES_VLLM=0\.8\.0"):
        cli.refuse_off_default(project.for_release("0.7.0"), args("export"))
    for command in ("check", "doc", "matrix", "pin"):
        with pytest.raises(HarnessError, match="unset it"):
            cli.refuse_off_default(project.for_release("0.8.0"), args(command))
    cli.refuse_off_default(project, args("check"))


def test_check_covers_the_backport_and_reports_it_by_folder(project: Project, commit) -> None:
    backport = _backport(project, commit)
    assert checks.check_series(backport) == []
    # a hand edit of the backport's patch fails its round trip, named by folder
    (patch,) = backport.patches.glob("0*.patch")
    patch.write_text(patch.read_text() + "\n")
    problems = checks.check_series(backport)
    assert problems and all(p.startswith("patches/0.9.0: ") for p in problems)
    assert checks.check_series(project) == []


def test_the_matrix_record_must_match_the_committed_series(project: Project, commit) -> None:
    backport = _backport(project, commit)
    path = project.results / "matrix.json"
    path.parent.mkdir(parents=True)
    record = {"data": {"series": matrix.series_record(project)}}
    path.write_text(json.dumps(record))
    assert checks.stale_record(project) == []
    (backport.patches / "series").write_text(
        "# changed\n" + (backport.patches / "series").read_text()
    )
    (problem,) = checks.stale_record(project)
    assert "vLLM 0.9.0 from patches/0.9.0" in problem and "matrix -- --test" in problem
    path.write_text(json.dumps({"data": {}}))
    assert "records no series" in checks.stale_record(project)[0]


def test_every_patch_is_authored_and_signed_off_by_the_pinned_identity(
    project: Project, commit
) -> None:
    commit("[Bugfix] One change", {"a.txt": "a\n"})
    series.export(project)
    assert checks.check_authorship(project) == []
    (patch,) = checks.series_files(project)
    identity = project.pin.identity
    text = patch.read_text()
    patch.write_text(
        text.replace(f"From: {identity.name}", "From: Someone Else", 1).replace(
            identity.signoff + "\n", ""
        )
    )
    problems = checks.check_authorship(project)
    assert len(problems) == 2
    assert "author 'Someone Else <" in problems[0] and "not the pinned" in problems[0]
    assert "no 'Signed-off-by: " in problems[1]


def test_the_real_matrix_record_is_the_committed_series() -> None:
    assert checks.stale_record(Project.discover()) == []


def test_the_real_backport_is_pinned_for_the_releases_before_the_base() -> None:
    pin = Pin.load(REPO / "patches" / "base.toml")
    for release in pin.matrix:
        assert Pin.load(REPO / "patches" / "base.toml", release.version).series == "0.33.0"
    assert (REPO / "patches" / "0.33.0" / "series").is_file()
    assert pin.series is None


def test_pin_is_a_command(capsys, monkeypatch) -> None:
    assert cli.parse(["pin", "0.35.0"]).version == "0.35.0"
    assert cli.parse(["pin", "--newer"]).newer
    monkeypatch.setattr(pinning, "newer_releases", lambda project: ["9.9.9"])
    assert cli.main(["pin", "--newer"]) == 1
    assert "9.9.9" in capsys.readouterr().out


def test_apply_on_another_release_borrows_the_blobs_a_3way_merge_needs(
    project: Project, commit
) -> None:
    layer = (project.tree / "vllm/layer.py").read_text().replace("line 5\n", "line five\n")
    commit("[Core] Change layer", {"vllm/layer.py": layer})
    series.export(project)
    # the release moved a line of the hunk's context: only a 3-way merge applies it
    moved = FILES["vllm/layer.py"].replace("line 3\n", "line three\n")
    release = pin_release(project, "1.1.0", {**FILES, "vllm/layer.py": moved})
    (result,) = series.apply(release)
    assert result.outcome.value == "3way"
    assert (release.tree / "vllm/layer.py").read_text().count(
        "line three\nline 4\nline five\n"
    ) == 1
    assert series.borrow_objects(release, release.tree) == ["1.0.0"]
