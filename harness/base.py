"""Stage 1: turn a pinned vLLM release into a git tree.

The base is the release's sdist (it carries ``tests/`` and ``csrc/``, which the
wheel lacks). It is fetched once through the package index's simple API, kept
in the cache, checked against the pinned sha256 on every use, unpacked, and
committed as a single commit with pinned identity and date, tagged
``v<version>``. The same sdist always gives the same commit id.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

from harness.project import HarnessError, Identity, Project, Release, git, progress, sha256_file

_SIMPLE_ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"


def index_url() -> str:
    """The simple-API index pip is configured with (``pip config``), or pip's default."""
    if url := os.environ.get("PIP_INDEX_URL"):
        return url
    proc = subprocess.run(
        ["pip", "config", "get", "global.index-url"], capture_output=True, text=True, check=False
    )
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.strip()
    from pip._internal.models.index import PyPI  # pip's own default, not ours to hardcode

    return str(PyPI.simple_url)


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            name = urllib.parse.unquote(href.split("#", 1)[0].rsplit("/", 1)[-1])
            self.links[name] = href


def index_files(project: str, index: str | None = None) -> dict[str, str]:
    """Every file the index's simple page lists for ``project``: name -> absolute URL.

    ``pip download`` cannot fetch vLLM's sdist (it builds metadata first), so
    the harness reads the listing itself; both PEP 691 JSON and PEP 503 HTML
    pages are understood.
    """
    root = index or index_url()
    # urljoin replaces the last path segment of a root without a slash
    page = urllib.parse.urljoin(root if root.endswith("/") else root + "/", f"{project}/")
    request = urllib.request.Request(page, headers={"Accept": _SIMPLE_ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            body = resp.read().decode()
            ctype = resp.headers.get("Content-Type", "")
    except OSError as exc:
        raise HarnessError(f"cannot read the index page {page}: {exc}") from exc
    if "json" in ctype:
        links: dict[str, str] = {f["filename"]: f["url"] for f in json.loads(body)["files"]}
    else:
        parser = _Anchors()
        parser.feed(body)
        links = parser.links
    return {name: urllib.parse.urljoin(page, url) for name, url in links.items()}


def find_file_url(project: str, filename: str, index: str | None = None) -> str:
    """URL of ``filename`` as listed by the index's simple page for ``project``."""
    links = index_files(project, index)
    if filename not in links:
        raise HarnessError(f"{filename} is not listed on the index page of {project}")
    return links[filename]


def fetch(project: Project, filename: str, sha256: str | None) -> Path:
    """The release file ``filename`` in the cache, downloaded once from the index.

    With ``sha256`` the file, cached or new, must have that hash: a cached file
    that differs is an error, not a silent re-download (something changed it,
    and the user should know). Without it (pinning a new release) the caller
    computes the hash from the file.
    """
    dest = project.cache / "dist" / filename
    if dest.exists():
        if sha256 is not None:
            _verify(dest, sha256)
        return dest
    url = find_file_url("vllm", filename)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(dest.suffix + ".part")
    progress(f"downloading {filename}")
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, part.open("wb") as out:
            total = int(resp.headers.get("Content-Length") or 0)
            done, shown = 0, 0
            while block := resp.read(1 << 22):
                out.write(block)
                done += len(block)
                if total and done * 10 // total > shown:
                    shown = done * 10 // total
                    progress(f"  {filename}: {done >> 20} of {total >> 20} MiB")
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise HarnessError(f"download of {filename} failed: {exc}") from exc
    if sha256 is not None:
        try:
            _verify(part, sha256)
        except HarnessError:
            part.unlink()
            raise
    part.rename(dest)
    return dest


def _verify(path: Path, sha256: str) -> None:
    actual = sha256_file(path)
    if actual != sha256:
        raise HarnessError(
            f"{path} has sha256 {actual}, but the pin says {sha256}.\n"
            f"Nothing was unpacked. Delete the file to download it again, or fix "
            f"patches/base.toml if the pin is what is wrong."
        )


def materialize(project: Project, release: Release, dest: Path, identity: Identity) -> str:
    """Create (or reuse) the git tree of ``release`` at ``dest``; return the base commit id.

    An existing tree is reused when its tag points at the expected commit; any
    other existing directory is refused rather than replaced.
    """
    sdist = fetch(project, release.sdist, release.sdist_sha256)
    if dest.exists():
        return _existing_base(dest, release)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        progress(f"unpacking {release.sdist}")
        with tarfile.open(sdist) as tar:
            tar.extractall(staging, filter="data")
        (top,) = staging.iterdir()
        git(top, "init", "-q", "--initial-branch=series")
        progress(f"committing the {release.tag} base (one commit, pinned identity)")
        git(top, "add", "--all", "--force")
        message = (
            f"vLLM {release.version} from its sdist\n\n"
            f"sdist: {release.sdist}\nsdist-sha256: {release.sdist_sha256}\n"
        )
        git(top, "commit", "-q", "--no-verify", "-m", message, env=identity.env())
        git(top, "tag", release.tag)
        top.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return base_commit(dest, release)


def base_commit(tree: Path, release: Release) -> str:
    return git(tree, "rev-parse", f"{release.tag}^{{commit}}").stdout.strip()


def _existing_base(dest: Path, release: Release) -> str:
    if not (dest / ".git").exists():
        raise HarnessError(
            f"{dest} exists but is not a harness tree; move it away (nothing is overwritten)"
        )
    proc = git(dest, "rev-parse", "-q", "--verify", f"{release.tag}^{{commit}}", check=False)
    if proc.returncode != 0:
        raise HarnessError(f"{dest} has no tag {release.tag}; it was not made by the harness")
    return proc.stdout.strip()
