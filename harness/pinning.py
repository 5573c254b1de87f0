"""``python -m harness pin VERSION``: pin a vLLM release from the index, no hand edits.

A release the pipeline can run on needs, in ``patches/base.toml``: the sdist's
and the release wheel's sha256, the upstream commit, the synthetic base commit
the harness makes from the sdist, and the torch and FlashInfer its
``requirements/cuda.txt`` names. Every one of them is derived here from the
downloaded files (hashes computed, never copied from a web page), and the
entry is appended to ``patches/base.toml`` with the file's comments kept.

:func:`newer_releases` lists releases on the index newer than every pin; the
revision matrix reports them so a scheduled job notices a new release.
"""

from __future__ import annotations

import re
import tarfile
import tempfile
from pathlib import Path

from harness.base import fetch, index_files, materialize
from harness.project import HarnessError, Project, Release, progress, sha256_file

# vLLM's release wheel: one stable-ABI x86-64 build per release.
WHEEL_PLATFORM = "cp38-abi3-manylinux_2_28_x86_64"
_FINAL = re.compile(r"^vllm-(\d+)\.(\d+)\.(\d+)\.tar\.gz$")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _member(tar: tarfile.TarFile, top: str, path: str) -> str:
    try:
        member = tar.extractfile(f"{top}/{path}")
    except KeyError:
        member = None
    if member is None:
        raise HarnessError(f"the sdist has no {path}")
    return member.read().decode()


def _requirement(text: str, name: str) -> str:
    """The ``==`` pin of ``name`` in a requirements file."""
    for line in text.splitlines():
        found = re.match(rf"^{re.escape(name)}\s*==\s*([^\s;#]+)", line.strip())
        if found:
            return found.group(1)
    raise HarnessError(f"requirements/cuda.txt pins no {name}")


def read_sdist(sdist: Path, version: str) -> dict[str, str]:
    """Upstream commit and the torch and FlashInfer pins, from the sdist itself."""
    top = f"vllm-{version}"
    with tarfile.open(sdist) as tar:
        version_py = _member(tar, top, "vllm/_version.py")
        cuda = _member(tar, top, "requirements/cuda.txt")
    found = re.search(r"commit_id\s*=\s*['\"]g?([0-9a-f]{7,40})['\"]", version_py)
    if found is None:
        raise HarnessError(f"{sdist.name}: vllm/_version.py records no commit id")
    return {
        "upstream_commit": found.group(1),
        "torch": _requirement(cuda, "torch"),
        "flashinfer": _requirement(cuda, "flashinfer-python"),
    }


def release_entry(project: Project, version: str) -> dict[str, str]:
    """Everything ``[[matrix]]`` pins for ``version``, from the index's files."""
    sdist_name = f"vllm-{version}.tar.gz"
    wheel = f"vllm-{version}-{WHEEL_PLATFORM}.whl"
    sdist = fetch(project, sdist_name, None)
    wheel_path = fetch(project, wheel, None)
    sdist_sha = sha256_file(sdist)
    entry = {"version": version, "sdist_sha256": sdist_sha, **read_sdist(sdist, version)}
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"making the synthetic base commit of vLLM {version}")
        base = materialize(
            project, Release(version, sdist_sha), Path(tmp) / "vllm", project.pin.identity
        )
    entry.update(base_commit=base, wheel=wheel, wheel_sha256=sha256_file(wheel_path))
    return entry


ENTRY_ORDER = (
    "version", "sdist_sha256", "upstream_commit", "base_commit", "wheel", "wheel_sha256",
    "torch", "flashinfer", "series",
)  # fmt: skip


def render_entry(entry: dict[str, str]) -> str:
    """One ``[[matrix]]`` table, keys in the file's usual order."""
    lines = ["[[matrix]]"] + [f'{k} = "{entry[k]}"' for k in ENTRY_ORDER if k in entry]
    return "\n".join(lines) + "\n"


def pin(project: Project, version: str, series: str | None = None) -> dict[str, str]:
    """Append ``version``'s ``[[matrix]]`` entry to ``patches/base.toml``.

    ``series`` names the folder under ``patches/`` whose series that release
    uses (default: the main series). A release already pinned is refused.
    """
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise HarnessError(f"{version!r} is not a release version such as 0.35.0")
    pinned = {r.version for r in project.pin.releases}
    if version in pinned:
        raise HarnessError(f"vLLM {version} is already pinned in {project.pin_file}")
    if series is not None and not (project.root / "patches" / series / "series").is_file():
        raise HarnessError(f"patches/{series}/series does not exist")
    entry = release_entry(project, version)
    if series is not None:
        entry["series"] = series
    text = project.pin_file.read_text()
    project.pin_file.write_text(text.rstrip("\n") + "\n\n" + render_entry(entry))
    return entry


def newer_releases(project: Project, files: dict[str, str] | None = None) -> list[str]:
    """Final releases on the index newer than every release ``patches/base.toml`` pins."""
    names = index_files("vllm") if files is None else files
    newest = max(_version_key(r.version) for r in project.pin.releases)
    found = []
    for name in names:
        match = _FINAL.match(name)
        if match and tuple(int(g) for g in match.groups()) > newest:
            found.append(".".join(match.groups()))
    return sorted(found, key=_version_key)
