"""Stage 1: fetching, verifying and materializing the base."""

from __future__ import annotations

import typing

import pytest

from harness import base, series
from harness.project import HarnessError, Project, git
from tests.conftest import FILES, IDENTITY, make_sdist, write_pin


def test_tampered_sdist_is_refused_and_nothing_is_unpacked(tmp_path):
    proj = Project(root=tmp_path / "repo", cache=tmp_path / "cache", work=tmp_path / "work")
    (proj.cache / "dist").mkdir(parents=True)
    sha = make_sdist(proj.cache / "dist" / "vllm-1.0.0.tar.gz", "1.0.0", FILES)
    write_pin(proj.root, "1.0.0", sha, "unknown")
    # Same name, different bytes: a tampered or corrupted cache entry.
    make_sdist(proj.cache / "dist" / "vllm-1.0.0.tar.gz", "1.0.0", {**FILES, "evil.py": "x\n"})
    with pytest.raises(HarnessError, match=r"sha256[\s\S]*Nothing was unpacked"):
        base.materialize(proj, proj.pin.release, proj.tree, IDENTITY)
    assert not proj.tree.exists()
    assert not proj.work.exists() or not any(proj.work.iterdir())


def test_base_commit_is_identical_across_runs(project, tmp_path):
    again = base.materialize(project, project.pin.release, tmp_path / "second", IDENTITY)
    assert again == project.pin.base_commit
    assert git(tmp_path / "second", "tag", "--list").stdout.split() == ["v1.0.0"]


def test_existing_tree_is_reused_not_replaced(project):
    marker = project.tree / "untracked-note.txt"
    marker.write_text("mine\n")
    assert base.materialize(project, project.pin.release, project.tree, IDENTITY) == (
        project.pin.base_commit
    )
    assert marker.read_text() == "mine\n"


def test_foreign_directory_is_refused(project, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with pytest.raises(HarnessError, match="not a harness tree"):
        base.materialize(project, project.pin.release, foreign, IDENTITY)


def test_base_commit_must_match_the_pin(project):
    write_pin(project.root, "1.0.0", project.pin.release.sdist_sha256, "f" * 40)
    with pytest.raises(HarnessError, match="pins"):
        series.prepare(project)


def test_simple_index_listing_html(monkeypatch):
    page = b'<html><a href="../../files/vllm-1.0.0.tar.gz#sha256=ab">vllm-1.0.0.tar.gz</a></html>'

    class Response:
        headers: typing.ClassVar[dict[str, str]] = {"Content-Type": "text/html"}

        def read(self):
            return page

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(base.urllib.request, "urlopen", lambda *a, **k: Response())
    url = base.find_file_url("vllm", "vllm-1.0.0.tar.gz", "http://index.invalid/simple/")
    assert url == "http://index.invalid/files/vllm-1.0.0.tar.gz#sha256=ab"
    pages: list[str] = []

    def record(request, **kwargs):
        pages.append(request.full_url)
        return Response()

    monkeypatch.setattr(base.urllib.request, "urlopen", record)
    # pip's default index has no trailing slash: the project page is still below it
    base.find_file_url("vllm", "vllm-1.0.0.tar.gz", "http://index.invalid/simple")
    assert pages == ["http://index.invalid/simple/vllm/"]
    with pytest.raises(HarnessError, match="not listed"):
        base.find_file_url("vllm", "vllm-2.0.0.tar.gz", "http://index.invalid/simple/")
