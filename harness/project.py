"""Project layout, the base pin, and the small helpers every stage shares.

Everything the harness writes outside the repository goes under two roots:

* the *cache* (``$VLLM_SERIES_CACHE``, default ``~/.cache/vllm-series``):
  downloaded, hash-checked release files; safe to share between clones;
* the *work area* (``$VLLM_SERIES_WORK``, default ``<repo>/.work``): the
  materialized vLLM git tree, venvs and built wheels of this clone.

The series is made on the release ``[base]`` of ``patches/base.toml`` pins.
``$VLLM_SERIES_VLLM`` (or :meth:`Project.for_release`) selects another release
of its ``[[matrix]]`` list instead: every stage then uses that release's pins
(sdist, base commit, wheel, torch) and its own work area,
``<work>/releases/<version>``, so the base release's tree, venv and wheel are
never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


class HarnessError(RuntimeError):
    """A failure the user can act on; the CLI prints it without a traceback."""


@dataclasses.dataclass(frozen=True)
class Identity:
    """Author and committer of every commit the harness makes."""

    name: str
    email: str
    date: str

    def env(self) -> dict[str, str]:
        """Git environment that pins author, committer and both dates."""
        return {
            "GIT_AUTHOR_NAME": self.name,
            "GIT_AUTHOR_EMAIL": self.email,
            "GIT_AUTHOR_DATE": self.date,
            "GIT_COMMITTER_NAME": self.name,
            "GIT_COMMITTER_EMAIL": self.email,
            "GIT_COMMITTER_DATE": self.date,
        }

    @property
    def signoff(self) -> str:
        return f"Signed-off-by: {self.name} <{self.email}>"


@dataclasses.dataclass(frozen=True)
class Release:
    """One vLLM release the harness can materialize from its sdist."""

    version: str
    sdist_sha256: str

    @property
    def tag(self) -> str:
        return f"v{self.version}"

    @property
    def sdist(self) -> str:
        return f"vllm-{self.version}.tar.gz"


# Selects the release the pipeline runs on (a version of patches/base.toml).
RELEASE_ENV = "VLLM_SERIES_VLLM"

# What a [[matrix]] entry must pin, beyond its sdist, before the pipeline
# (apply, build, test) can run on that release.
RELEASE_KEYS = (
    "upstream_commit", "base_commit", "wheel", "wheel_sha256", "torch", "flashinfer",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Pin:
    """The contents of ``patches/base.toml``, for one selected release.

    ``release`` and the fields after it up to ``flashinfer`` describe the
    selected release: ``[base]`` by default, or one ``[[matrix]]`` entry.
    ``default`` is always ``[base]``'s release, the one ``patches/`` is made on.
    """

    release: Release
    upstream_commit: str
    base_commit: str
    wheel: str
    wheel_sha256: str
    torch: str
    flashinfer: str
    python: str
    identity: Identity
    matrix: tuple[Release, ...]
    default: Release
    # (pytest node id, why): series tests not run on this release, each with its
    # reason; a [[matrix]] entry's `deselect` table. Reported, never silent.
    deselect: tuple[tuple[str, str], ...] = ()
    # The folder under patches/ holding the series this release uses (its
    # `series` key): a maintained backport made on the release of the same
    # name. None: the main series, patches/ itself, made on [base]'s release.
    series: str | None = None
    # (requirement, why): replaces the release wheel's pin of that package when
    # the harness installs it (its `overrides` table), e.g. a pinned version the
    # index does not serve. Reported, never silent.
    overrides: tuple[tuple[str, str], ...] = ()

    @property
    def is_default(self) -> bool:
        """Whether the selected release is the one the series is made on."""
        return self.release == self.default

    @property
    def releases(self) -> tuple[Release, ...]:
        """Every release the file pins: the ``[[matrix]]`` ones, then ``[base]``'s."""
        return (*self.matrix, self.default)

    @classmethod
    def load(cls, path: Path, version: str | None = None) -> Pin:
        """The pin of ``version`` (default: ``[base]``'s release) from ``path``."""
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise HarnessError(f"cannot read the base pin {path}: {exc}") from exc
        base = data["base"]
        default = Release(base["version"], base["sdist_sha256"])
        if base["sdist"] != default.sdist or base["tag"] != default.tag:
            raise HarnessError(f"{path}: sdist/tag do not match version {default.version}")
        entries = data.get("matrix", [])
        matrix = tuple(Release(m["version"], m["sdist_sha256"]) for m in entries)
        chosen = base
        if version is not None and version != default.version:
            chosen = _matrix_entry(path, entries, version, default.version)
        return cls(
            release=Release(chosen["version"], chosen["sdist_sha256"]),
            upstream_commit=chosen["upstream_commit"],
            base_commit=chosen["base_commit"],
            wheel=chosen["wheel"],
            wheel_sha256=chosen["wheel_sha256"],
            torch=chosen["torch"],
            flashinfer=chosen["flashinfer"],
            python=base["python"],
            identity=Identity(**data["identity"]),
            matrix=matrix,
            default=default,
            deselect=tuple(dict(chosen.get("deselect", {})).items()),
            series=chosen.get("series"),
            overrides=tuple(dict(chosen.get("overrides", {})).items()),
        )

    @property
    def home(self) -> str:
        """The release the selected series is made on (a backport folder is named after it)."""
        return self.series or self.default.version


def _matrix_entry(
    path: Path, entries: list[dict[str, Any]], version: str, default: str
) -> dict[str, Any]:
    """The ``[[matrix]]`` entry of ``version``; refused unless it has all :data:`RELEASE_KEYS`."""
    found = [m for m in entries if m["version"] == version]
    if not found:
        known = ", ".join([*(m["version"] for m in entries), default])
        raise HarnessError(
            f"vLLM {version} is not pinned in {path} (${RELEASE_ENV}); pinned releases: {known}"
        )
    missing = [k for k in RELEASE_KEYS if k not in found[0]]
    if missing:
        raise HarnessError(
            f"{path}: the [[matrix]] entry of vLLM {version} lacks {', '.join(missing)}, "
            f"so the pipeline cannot run on it (the revision matrix can still classify it)"
        )
    return found[0]


@dataclasses.dataclass(frozen=True)
class Project:
    """Where things are: the repository, its patches, the cache, the work area.

    ``vllm`` is the selected release (``None``: ``[base]``'s); ``work`` is
    already that release's own work area.
    """

    root: Path
    cache: Path
    work: Path
    vllm: str | None = None

    @classmethod
    def discover(cls, root: Path = REPO, env: Mapping[str, str] = os.environ) -> Project:
        cache = env.get("VLLM_SERIES_CACHE") or str(Path.home() / ".cache" / "vllm-series")
        work = env.get("VLLM_SERIES_WORK") or str(root / ".work")
        project = cls(root=root, cache=Path(cache), work=Path(work))
        version = env.get(RELEASE_ENV, "").strip()
        if not version or version == project.pin.default.version:
            return project
        return project.for_release(version)

    def for_release(self, version: str) -> Project:
        """This project on release ``version``: its pins, work area ``<work>/releases/<version>``.

        Also for ``[base]``'s own version (the revision matrix runs every
        release apart from the default work area). The version is checked
        against ``patches/base.toml`` here, so a typo fails at once.
        """
        selected = dataclasses.replace(self, vllm=version, work=self.release_work(version))
        selected.pin  # noqa: B018 (raises for a release base.toml does not fully pin)
        return selected

    def series_for(self, version: str) -> Project:
        """This project on ``version`` when base.toml pins it fully, else as it is: a
        release the revision matrix only classifies uses the main series."""
        try:
            return self.for_release(version)
        except HarnessError:
            return self

    def release_work(self, version: str) -> Path:
        """The work area of release ``version``, ``<work>/releases/<version>`` (not checked)."""
        root_work = self.work if self.vllm is None else self.work.parent.parent
        return root_work / "releases" / version

    @property
    def pin_file(self) -> Path:
        """``patches/base.toml``: the pins of every release, and which series each uses."""
        return self.root / "patches" / "base.toml"

    @property
    def pin(self) -> Pin:
        return Pin.load(self.pin_file, self.vllm)

    @property
    def patches(self) -> Path:
        """The selected release's series: ``patches/``, or a backport folder under it."""
        series = None if self.vllm is None else self.pin.series
        return self.root / "patches" / series if series else self.root / "patches"

    @property
    def on_default(self) -> bool:
        """Whether the selected release is the one its series is made on: ``[base]``'s
        for ``patches/``, the folder's own release for a backport (``patches/0.33.0``)."""
        return self.vllm is None or self.pin.release.version == self.pin.home

    def backports(self) -> list[Project]:
        """This project on each release that has a backport series of its own."""
        homes = {r.version for r in self.pin.releases}
        folders = sorted(p.parent.name for p in (self.root / "patches").glob("*/series"))
        return [self.for_release(v) for v in folders if v in homes]

    @property
    def tree(self) -> Path:
        """The materialized vLLM git tree the series is applied in."""
        return self.work / "vllm"

    @property
    def results(self) -> Path:
        return self.root / "results"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Git reads no user or system configuration through the harness: aliases,
# format.* or am.* settings on one machine must not change the patches or the
# commit ids produced on another.
_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
    "LC_ALL": "C",
    "TZ": "UTC",
}


# No background `gc --auto` after am or commit: it would still be running, in a
# tree the harness considers finished, when the next step copies or reads it.
_GIT_CONFIG = ("-c", "core.autocrlf=false", "-c", "core.abbrev=12", "-c", "gc.auto=0",
               "-c", "maintenance.auto=false")  # fmt: skip


def git(
    repo: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``git -C repo args`` with a neutral configuration; capture output."""
    full_env = {**os.environ, **_GIT_ENV, **(env or {})}
    proc = subprocess.run(
        ["git", "-C", str(repo), *_GIT_CONFIG, *args],
        env=full_env,
        text=True,
        capture_output=True,
        check=False,
    )
    if check and proc.returncode != 0:
        raise HarnessError(
            f"git {' '.join(args)} failed in {repo} (exit {proc.returncode}):\n"
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc


def run(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
) -> None:
    """Run a command; stream its output to the terminal, or to ``log`` if given.

    On failure with a log, the log's last lines are part of the error.
    """
    progress("$ " + " ".join(str(c) for c in cmd))
    with open(log, "w") if log else contextlib.nullcontext() as out:
        proc = subprocess.run(
            [str(c) for c in cmd],
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT if log else None,
            check=False,
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:]) if log else ""
        raise HarnessError(
            f"{Path(str(cmd[0])).name} exited with {proc.returncode}"
            + (f"; last lines of {log}:\n{tail}" if log else "")
        )


def nvidia_smi(*fields: str) -> list[list[str]] | None:
    """``nvidia-smi --query-gpu=FIELDS`` as one row of values per GPU.

    ``None`` when there is no usable nvidia-smi (no driver, no GPU).
    """
    try:
        proc = subprocess.run(
            ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    return [[v.strip() for v in line.split(",")] for line in proc.stdout.strip().splitlines()]


def progress(message: str) -> None:
    """One line of progress on stderr, so long steps never look stuck."""
    print(f"[harness] {message}", file=sys.stderr, flush=True)
