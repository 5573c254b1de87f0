"""Stage 2: apply ``patches/`` as commits, export commits back as ``patches/``.

Rules that keep the round trip byte-stable and the commit ids machine-independent:

* apply is ``git am --3way --keep-non-patch`` one patch at a time, with the
  pinned committer identity and ``--committer-date-is-author-date``;
* export is ``git format-patch --zero-commit --no-signature --full-index
  --numbered --base=<base>``, run with no user git configuration;
* the work tree is never clobbered: uncommitted changes, commits that were not
  exported, or a stopped ``git am`` make apply refuse and say what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import re
import shutil
import tempfile
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.base import materialize
from harness.project import HarnessError, Identity, Project, git, progress

RESET_HINT = "python -m harness reset"


class Outcome(enum.Enum):
    """How one patch met a tree (the revision matrix uses all of them)."""

    CLEAN = "clean"  # git apply --check succeeds: applies exactly (offsets allowed)
    THREE_WAY = "3way"  # needed git am's 3-way merge
    UPSTREAM = "upstream"  # applied as a no-op: the change is already in the tree
    FAILED = "rebase"  # does not apply: the patch needs a rebase


@dataclasses.dataclass(frozen=True)
class PatchResult:
    patch: str
    outcome: Outcome
    files: tuple[str, ...] = ()
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Note:
    """Hand-written facts about one commit, from ``patches/notes.toml``."""

    patch: str
    why: str
    requires: tuple[int, ...]
    upstream: str
    evidence: tuple[str, ...]


def series_files(project: Project) -> list[Path]:
    """The patch files in ``patches/series`` order (blank lines and ``#`` comments ignored)."""
    listing = project.patches / "series"
    names = [
        line.strip()
        for line in listing.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    missing = [n for n in names if not (project.patches / n).is_file()]
    if missing:
        raise HarnessError(f"patches/series names missing files: {', '.join(missing)}")
    return [project.patches / n for n in names]


def series_hash(project: Project) -> str:
    """sha256 over the series list and every patch, in order (first 12 hex digits)."""
    digest = hashlib.sha256((project.patches / "series").read_bytes())
    for patch in series_files(project):
        digest.update(patch.read_bytes())
    return digest.hexdigest()[:12]


def load_notes(project: Project) -> dict[str, Note]:
    path = project.patches / "notes.toml"
    if not path.exists():
        return {}
    entries = tomllib.loads(path.read_text()).get("commit", [])
    notes = {
        e["patch"]: Note(
            patch=e["patch"],
            why=e["why"].strip(),
            requires=tuple(e.get("requires", ())),
            upstream=e["upstream"],
            evidence=tuple(e.get("evidence", ())),
        )
        for e in entries
    }
    names = [p.name for p in series_files(project)]
    if stray := sorted(set(notes) - set(names)):
        raise HarnessError(f"patches/notes.toml describes patches not in the series: {stray}")
    if missing := [n for n in names if n not in notes]:
        raise HarnessError(f"patches/notes.toml has no entry for: {missing}")
    return notes


# --------------------------------------------------------------------------- guards


def _am_in_progress(tree: Path) -> bool:
    gitdir = Path(git(tree, "rev-parse", "--absolute-git-dir").stdout.strip())
    return (gitdir / "rebase-apply").exists()


def ensure_clean(tree: Path) -> None:
    """Refuse a tree with a stopped ``git am`` or uncommitted changes."""
    if _am_in_progress(tree):
        raise HarnessError(
            f"{tree} has a stopped `git am`. Finish it there (git am --continue) "
            f"and run `python -m harness export`, or discard it with `{RESET_HINT}`."
        )
    status = git(tree, "status", "--porcelain", "--untracked-files=normal").stdout
    if status.strip():
        raise HarnessError(
            f"{tree} has uncommitted changes; commit them and run "
            f"`python -m harness export`, or stash them (git -C {tree} stash -u). "
            f"Nothing was changed.\n{status.rstrip()}"
        )


def _comparable(patch: Path) -> bytes:
    """Patch bytes without what depends on the series length: ``[PATCH n/m]`` and base info."""
    text = patch.read_bytes()
    text = re.sub(rb"(?m)^Subject: \[PATCH[^\]]*\]", b"Subject: [PATCH]", text)
    return text.split(b"\nbase-commit: ", 1)[0]


def ensure_exported(project: Project, tree: Path, base: str) -> None:
    """Refuse when a commit on top of ``base`` is not in ``patches/``.

    The tree's commits must reproduce the first patches of the series (a
    stopped or partial apply leaves such a prefix); anything else would be lost
    by rebuilding the branch.
    """
    listed = series_files(project)
    with tempfile.TemporaryDirectory() as tmp:
        exported = format_patches(tree, base, Path(tmp))
        same = len(exported) <= len(listed) and all(
            mine.name == theirs.name and _comparable(mine) == _comparable(theirs)
            for mine, theirs in zip(exported, listed, strict=False)
        )
    if not same:
        raise HarnessError(
            f"{tree} has commits that are not in patches/ (or patches/ changed since "
            f"they were applied). Run `python -m harness export` to keep the commits, "
            f"or `git -C {tree} branch -m series-saved` to set them aside; nothing was "
            f"changed."
        )


# --------------------------------------------------------------------------- apply


def _hunk_context(patch: Path, path: str, line: int) -> str:
    """The hunk of ``patch`` that touches ``path`` at old line ``line``."""
    text = patch.read_text(errors="replace")
    section = re.search(
        rf"^diff --git a/{re.escape(path)} b/.*?(?=^diff --git |^-- ?$|\Z)", text, re.M | re.S
    )
    if not section:
        return ""
    hunks = re.split(r"(?m)^(?=@@ )", section.group(0))[1:]
    for hunk in hunks:
        header = re.match(r"@@ -(\d+)", hunk)
        if header and int(header.group(1)) == line:
            return hunk.rstrip()
    return hunks[0].rstrip() if hunks else ""


def _failure(patch: Path, check_output: str, am_output: str) -> PatchResult:
    files = tuple(dict.fromkeys(re.findall(r"patch failed: (.+?):\d+", check_output)))
    conflicts = re.findall(r"CONFLICT \([^)]*\): .*? in (\S+)", am_output)
    files = tuple(dict.fromkeys(files + tuple(conflicts)))
    lines = [f"{patch.name} does not apply."]
    if files:
        lines.append("files: " + ", ".join(files))
    for path, line in re.findall(r"patch failed: (.+?):(\d+)", check_output)[:1]:
        if hunk := _hunk_context(patch, path, int(line)):
            lines += [f"first failing hunk ({path}):", hunk]
    lines.append("git am said:\n" + am_output.strip())
    return PatchResult(patch.name, Outcome.FAILED, files, "\n".join(lines))


def _committer(identity: Identity) -> dict[str, str]:
    """The pinned committer (the date comes from each patch: --committer-date-is-author-date)."""
    return {"GIT_COMMITTER_NAME": identity.name, "GIT_COMMITTER_EMAIL": identity.email}


def apply_patch(tree: Path, patch: Path, identity: Identity, *, abort: bool) -> PatchResult:
    """Apply one patch as one commit and classify how it went.

    On failure the ``git am`` is aborted when ``abort`` is true; otherwise it is
    left stopped for the user to inspect.
    """
    committer = _committer(identity)
    check = git(tree, "apply", "--check", "--verbose", str(patch), check=False)
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    am = git(
        tree,
        "am",
        "--3way",
        "--keep-non-patch",
        "--committer-date-is-author-date",
        "--quiet",
        str(patch),
        env=committer,
        check=False,
    )
    if am.returncode != 0:
        reverse = git(tree, "apply", "--check", "--reverse", str(patch), check=False)
        if reverse.returncode == 0:
            # Without the patch's pre-image blobs am cannot see that the change is
            # already there; the reverse patch applying cleanly shows it.
            git(tree, "am", "--abort", env=committer)
            return PatchResult(patch.name, Outcome.UPSTREAM, detail="its reverse applies")
        result = _failure(patch, check.stderr + check.stdout, am.stdout + am.stderr)
        if abort:
            git(tree, "am", "--abort", env=committer)
        return result
    if git(tree, "rev-parse", "HEAD").stdout.strip() == head:
        return PatchResult(patch.name, Outcome.UPSTREAM, detail="applied as a no-op")
    touched = tuple(git(tree, "diff", "--name-only", "HEAD~1", "HEAD").stdout.split())
    outcome = Outcome.CLEAN if check.returncode == 0 else Outcome.THREE_WAY
    return PatchResult(patch.name, outcome, touched)


def apply_series(
    tree: Path, patches: Sequence[Path], identity: Identity, *, abort: bool
) -> list[PatchResult]:
    """Apply ``patches`` in order on the checked-out branch; stop at the first failure."""
    results = []
    for index, patch in enumerate(patches, 1):
        progress(f"applying [{index}/{len(patches)}] {patch.name}")
        result = apply_patch(tree, patch, identity, abort=abort)
        results.append(result)
        if result.outcome is Outcome.FAILED:
            break
    return results


def prepare(project: Project) -> tuple[Path, str]:
    """Materialize the pinned base; return the tree and its base commit."""
    pin = project.pin
    tree = project.tree
    base = materialize(project, pin.release, tree, pin.identity)
    if base != pin.base_commit:
        raise HarnessError(
            f"the base commit of {tree} is {base}, but patches/base.toml pins "
            f"{pin.base_commit}: the tree was not made from the pinned sdist by this "
            f"harness. Move {tree} away and run `python -m harness base`."
        )
    return tree, base


def apply(project: Project) -> list[PatchResult]:
    """``python -m harness apply``: rebuild the ``series`` branch from the base and apply."""
    tree, base = prepare(project)
    ensure_clean(tree)
    branch = git(tree, "symbolic-ref", "--short", "-q", "HEAD", check=False).stdout.strip()
    if branch != "series":
        raise HarnessError(
            f"{tree} has {branch or 'a detached HEAD'} checked out, not `series`; "
            f"check out `series` there first (nothing was changed)"
        )
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    if head != base:
        ensure_exported(project, tree, base)
    git(tree, "reset", "-q", "--hard", base)
    results = apply_series(tree, series_files(project), project.pin.identity, abort=False)
    _raise_for(results, stopped=True)
    return results


def _raise_for(results: Sequence[PatchResult], *, stopped: bool) -> None:
    for result in results:
        if result.outcome is Outcome.FAILED:
            hint = (
                f"\nThe tree is left at the stopped `git am` for inspection; "
                f"`{RESET_HINT}` returns it to the base."
                if stopped
                else ""
            )
            raise HarnessError(result.detail + hint)
        if result.outcome is Outcome.UPSTREAM:
            raise HarnessError(
                f"{result.patch} is already upstream in this base (it applied as a "
                f"no-op); drop it from patches/series."
            )


def reset(project: Project) -> None:
    """``python -m harness reset``: abort a stopped apply and return ``series`` to the base."""
    tree, base = prepare(project)
    if _am_in_progress(tree):
        progress("aborting the stopped git am")
        git(tree, "am", "--abort", env=_committer(project.pin.identity))
    ensure_clean(tree)
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    if head != base:
        ensure_exported(project, tree, base)
    git(tree, "checkout", "-q", "-B", "series", base)


# --------------------------------------------------------------------------- export


def format_patches(
    tree: Path, base: str, out: Path, *, signoff: Identity | None = None
) -> list[Path]:
    """Write the commits ``base..HEAD`` of ``tree`` as numbered patch files into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    count = int(git(tree, "rev-list", "--count", f"{base}..HEAD").stdout)
    if count == 0:
        return []
    args = [
        "format-patch",
        "--zero-commit",
        "--no-signature",
        "--full-index",
        "--numbered",
        f"--base={base}",
        "-o",
        str(out),
    ]
    env = None
    if signoff is not None:
        args.append("--signoff")
        env = {"GIT_COMMITTER_NAME": signoff.name, "GIT_COMMITTER_EMAIL": signoff.email}
    names = git(tree, *args, f"{base}..HEAD", env=env).stdout.split()
    return [Path(n) for n in names]


SERIES_HEADER = (
    "# Patch order for `python -m harness apply` (git am --3way --keep-non-patch).\n"
    "# Generated by `python -m harness export`; do not edit by hand.\n"
)


def export(
    project: Project, *, signoff: Identity | None = None, out: Path | None = None
) -> list[Path]:
    """``python -m harness export``: regenerate ``patches/`` (or ``out``) from the tree.

    With ``signoff`` the submitter's ``Signed-off-by`` is added; such a series
    differs from ``patches/`` by design, so it must go to ``out``.
    """
    if signoff is not None and out is None:
        raise HarnessError("--signoff writes a submission copy: give it --out DIR")
    tree, base = prepare(project)
    ensure_clean(tree)
    target = out or project.patches
    if out is None:
        for old in project.patches.glob("[0-9][0-9][0-9][0-9]-*.patch"):
            old.unlink()
    written = format_patches(tree, base, target, signoff=signoff)
    listing = SERIES_HEADER + "".join(f"{p.name}\n" for p in written)
    (target / "series").write_text(listing)
    progress(f"exported {len(written)} patch(es) to {target}")
    return written


# --------------------------------------------------------------------------- check


@contextlib.contextmanager
def scratch_tree(tree: Path, commit: str) -> Iterator[Path]:
    """A throw-away worktree of ``tree`` detached at ``commit``."""
    tmp = Path(tempfile.mkdtemp(prefix="harness-wt-"))
    path = tmp / "tree"
    git(tree, "worktree", "add", "-q", "--detach", str(path), commit)
    try:
        yield path
    finally:
        git(tree, "worktree", "remove", "--force", str(path), check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        git(tree, "worktree", "prune", check=False)


def check_round_trip(project: Project, tree: Path, base: str) -> list[str]:
    """Apply the series in a scratch tree, export it, and compare with ``patches/``."""
    problems = []
    patches = series_files(project)
    with scratch_tree(tree, base) as work, tempfile.TemporaryDirectory() as tmp:
        results = apply_series(work, patches, project.pin.identity, abort=True)
        try:
            _raise_for(results, stopped=False)
        except HarnessError as exc:
            return [str(exc)]
        out = Path(tmp)
        written = format_patches(work, base, out)
        if [p.name for p in written] != [p.name for p in patches]:
            problems.append(f"export names {[p.name for p in written]} differ from patches/series")
        for patch in patches:
            regenerated = out / patch.name
            if regenerated.exists() and regenerated.read_bytes() != patch.read_bytes():
                problems.append(f"{patch.name} does not round-trip byte for byte")
    return problems


def check(project: Project) -> list[str]:
    """``python -m harness check``: round trip, standalone commits, fresh SERIES.md."""
    from harness import document, results

    tree, base = prepare(project)
    problems = check_round_trip(project, tree, base)
    problems += results.check_all(project.root)
    problems += check_standalone(project, tree, base)
    problems += [
        f"{name}: generated blocks are stale; run `python -m harness doc`"
        for name in document.stale(project)
    ]
    return problems


def check_standalone(project: Project, tree: Path, base: str) -> list[str]:
    """Apply each patch alone on the base its note names (bare base, or base + prerequisites)."""
    problems = []
    patches = series_files(project)
    for index, note in enumerate(load_notes(project).values(), 1):
        prereqs = [patches[i - 1] for i in note.requires]
        with scratch_tree(tree, base) as work:
            results = apply_series(
                work, [*prereqs, patches[index - 1]], project.pin.identity, abort=True
            )
        last = results[-1]
        if len(results) != len(prereqs) + 1 or last.outcome in (Outcome.FAILED, Outcome.UPSTREAM):
            where = (
                "the bare base"
                if not prereqs
                else "base + " + ", ".join(f"{i:04d}" for i in note.requires)
            )
            problems.append(f"{note.patch} does not apply alone on {where}: {last.detail}")
    return problems


def touched_files(tree: Path, base: str, revision: str = "HEAD", under: str = "tests") -> list[str]:
    """Files below ``under`` that ``base..revision`` adds or changes."""
    return sorted(
        git(
            tree, "diff", "--name-only", "--diff-filter=AM", f"{base}..{revision}", "--", under
        ).stdout.split()
    )


def touched_tests(tree: Path, base: str, revision: str = "HEAD") -> list[str]:
    """Test files (``tests/**/test_*.py``) that ``base..revision`` adds or changes.

    ``revision`` defaults to the checked-out commit (``harness test``); the
    device bundle passes the commit it packs.
    """
    return [
        n
        for n in touched_files(tree, base, revision)
        if Path(n).name.startswith("test_") and n.endswith(".py")
    ]
