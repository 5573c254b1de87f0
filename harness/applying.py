"""Applying patches to a tree, and applying them alone in a clone that holds only a base.

:func:`apply_patch` decides how one patch meets a tree *before* it runs
``git am``, on the clean tree: a patch whose forward check fails is
``upstream`` only when its post-image blobs are already at its paths, or its
reverse applies. A failed 3-way ``git am`` leaves conflict files in the work
tree, so nothing is judged after it.

:func:`apply_alone` is the one routine the standalone check and the revision
matrix share. It applies in a fresh clone whose object store holds only the
base's objects (what a fork that cherry-picks one commit has), never in a
worktree of the fully applied tree, whose blobs would let a 3-way merge
succeed where a fork's could not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from harness.patches import file_changes, hunk_context
from harness.project import HarnessError, Identity, git, progress


class Outcome(enum.Enum):
    """How one patch met a tree (the revision matrix uses all of them)."""

    CLEAN = "clean"  # git apply --check succeeds: applies exactly (offsets allowed)
    THREE_WAY = "3way"  # needed git am's 3-way merge
    UPSTREAM = "upstream"  # the change is already in the tree
    FAILED = "rebase"  # does not apply: the patch needs a rebase


@dataclasses.dataclass(frozen=True)
class PatchResult:
    patch: str
    outcome: Outcome
    files: tuple[str, ...] = ()
    detail: str = ""


def committer(identity: Identity) -> dict[str, str]:
    """The pinned committer (the date comes from each patch: --committer-date-is-author-date)."""
    return {"GIT_COMMITTER_NAME": identity.name, "GIT_COMMITTER_EMAIL": identity.email}


def already_applied(tree: Path, patch: Path) -> str:
    """Why ``patch`` is already in the clean tree ``tree``, or ``""`` when it is not.

    Only meaningful when the patch's forward check fails and the tree has no
    local changes: the post-image blobs of every file at its paths (deleted
    files absent, renamed sources gone), or else its reverse applying cleanly.
    """
    changes = file_changes(patch)
    paths = sorted({p for c in changes for p in (c.old_path, c.new_path) if p})
    entries = git(tree, "ls-tree", "-r", "-z", "HEAD", "--", *paths).stdout.split("\0")
    listed = dict(
        (name, blob)
        for entry in entries
        if entry
        for blob, name in [entry.split(" ", 2)[2].split("\t", 1)]
    )

    def in_place(old: str | None, new: str | None, blob: str | None) -> bool:
        if new is None:
            return old not in listed
        moved_away = old is None or old == new or old not in listed
        return blob is not None and listed.get(new) == blob and moved_away

    if changes and all(in_place(c.old_path, c.new_path, c.post_blob) for c in changes):
        return "its post-image blobs are already at its paths"
    reverse = git(tree, "apply", "--check", "--reverse", str(patch), check=False)
    if reverse.returncode == 0:
        return "its reverse applies to the clean tree"
    return ""


def _failure(patch: Path, check_output: str, am_output: str) -> PatchResult:
    files = tuple(dict.fromkeys(re.findall(r"patch failed: (.+?):\d+", check_output)))
    files += tuple(re.findall(r"error: (\S+): does not exist in index", check_output))
    conflicts = re.findall(r"CONFLICT \([^)]*\): .*? in (\S+)", am_output)
    files = tuple(dict.fromkeys(files + tuple(conflicts)))
    lines = [f"{patch.name} does not apply."]
    if files:
        lines.append("files: " + ", ".join(files))
    for path, line in re.findall(r"patch failed: (.+?):(\d+)", check_output)[:1]:
        if hunk := hunk_context(patch, path, int(line)):
            lines += [f"first failing hunk ({path}):", hunk]
    said = am_output.strip() or check_output.strip()
    lines.append(("git am said:\n" if am_output.strip() else "git apply said:\n") + said)
    return PatchResult(patch.name, Outcome.FAILED, files, "\n".join(lines))


def apply_patch(
    tree: Path, patch: Path, identity: Identity, *, abort: bool, three_way: bool = True
) -> PatchResult:
    """Apply one patch as one commit on the clean tree ``tree`` and classify how it went.

    With ``three_way`` (the series' own apply) ``git am --3way`` may merge;
    without it the patch must apply as ``git am --keep-non-patch`` applies it.
    On failure the ``git am`` is aborted when ``abort`` is true; otherwise it is
    left stopped for the user to resolve.
    """
    check = git(tree, "apply", "--check", "--verbose", str(patch), check=False)
    if check.returncode != 0:
        if reason := already_applied(tree, patch):
            return PatchResult(patch.name, Outcome.UPSTREAM, detail=reason)
        if not three_way:
            return _failure(patch, check.stderr + check.stdout, "")
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    am = git(
        tree,
        "am",
        *(["--3way"] if three_way else []),
        "--keep-non-patch",
        "--committer-date-is-author-date",
        "--quiet",
        str(patch),
        env=committer(identity),
        check=False,
    )
    if am.returncode != 0:
        result = _failure(patch, check.stderr + check.stdout, am.stdout + am.stderr)
        if abort:
            git(tree, "am", "--abort", env=committer(identity))
        return result
    if git(tree, "rev-parse", "HEAD").stdout.strip() == head:
        return PatchResult(patch.name, Outcome.UPSTREAM, detail="applied as a no-op")
    touched = tuple(git(tree, "diff", "--name-only", "HEAD~1", "HEAD").stdout.split())
    outcome = Outcome.CLEAN if check.returncode == 0 else Outcome.THREE_WAY
    return PatchResult(patch.name, outcome, touched)


def apply_series(
    tree: Path,
    patches: Sequence[Path],
    identity: Identity,
    *,
    abort: bool,
    three_way: bool = True,
) -> list[PatchResult]:
    """Apply ``patches`` in order on the checked-out branch; stop at the first failure.

    A patch found upstream makes no commit and does not stop the run.
    """
    results = []
    for index, patch in enumerate(patches, 1):
        progress(f"applying [{index}/{len(patches)}] {patch.name}")
        result = apply_patch(tree, patch, identity, abort=abort, three_way=three_way)
        results.append(result)
        if result.outcome is Outcome.FAILED:
            break
    return results


def blocking(results: Sequence[PatchResult]) -> PatchResult | None:
    """The result that stopped a run of :func:`apply_series`, if one did."""
    for result in results:
        if result.outcome in (Outcome.FAILED, Outcome.UPSTREAM):
            return result
    return None


@contextlib.contextmanager
def scratch_tree(tree: Path, commit: str) -> Iterator[Path]:
    """A throw-away worktree of ``tree`` detached at ``commit`` (it shares ``tree``'s objects)."""
    tmp = Path(tempfile.mkdtemp(prefix="harness-wt-"))
    path = tmp / "tree"
    git(tree, "worktree", "add", "-q", "--detach", str(path), commit)
    try:
        yield path
    finally:
        git(tree, "worktree", "remove", "--force", str(path), check=False)
        shutil.rmtree(tmp, ignore_errors=True)
        git(tree, "worktree", "prune", check=False)


@contextlib.contextmanager
def base_store(sources: Sequence[tuple[Path, str]]) -> Iterator[Path]:
    """A bare repository with only the objects of the given ``(repository, tag)`` pairs.

    It stands for what a fork of upstream has: the releases, none of the
    series' blobs. Clones made by :func:`fresh_clone` borrow its objects and
    write their own elsewhere, so it stays that way.
    """
    tmp = Path(tempfile.mkdtemp(prefix="harness-base-"))
    store = tmp / "base.git"
    try:
        git(tmp, "init", "-q", "--bare", str(store))
        for repo, tag in sources:
            git(store, "fetch", "-q", "--no-tags", str(repo), f"+refs/tags/{tag}:refs/tags/{tag}")
        yield store
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def fresh_clone(store: Path, commit: str) -> Iterator[Path]:
    """A new clone of ``store`` detached at ``commit``; its new objects stay its own."""
    tmp = Path(tempfile.mkdtemp(prefix="harness-clone-"))
    path = tmp / "tree"
    try:
        git(tmp, "clone", "-q", "--shared", "--no-checkout", str(store), str(path))
        git(path, "checkout", "-q", "--detach", commit)
        yield path
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def forget(clone: Path, base: str) -> None:
    """Return a :func:`fresh_clone` to ``base`` as if it were new: files, refs and objects.

    Its own object directory holds only what applying wrote (the base's
    objects are borrowed from the store), so emptying it leaves exactly the
    base's objects, without the cost of a new checkout.
    """
    git(clone, "reset", "-q", "--hard", base)
    git(clone, "clean", "-q", "-fdx")
    gitdir = clone / ".git"
    shutil.rmtree(gitdir / "logs", ignore_errors=True)
    for name in ("ORIG_HEAD", "FETCH_HEAD"):
        (gitdir / name).unlink(missing_ok=True)
    objects = gitdir / "objects"
    for entry in objects.iterdir():
        if re.fullmatch(r"[0-9a-f]{2}", entry.name):
            shutil.rmtree(entry)
    for pack in (objects / "pack").iterdir():
        pack.unlink()


def apply_alone(
    clone: Path,
    base: str,
    patches: Sequence[Path],
    identity: Identity,
    *,
    three_way: bool,
) -> list[PatchResult]:
    """Apply ``patches`` (prerequisites, then the patch in question) on ``base`` in ``clone``.

    ``clone`` is a :func:`fresh_clone` of a :func:`base_store`; it is first
    returned to the bare base with only the base's objects (:func:`forget`),
    so nothing an earlier call applied can help this one. The standalone
    claim uses ``three_way=False`` (plain ``git am --keep-non-patch``); the
    revision matrix uses ``True`` and reports the merges it needed as ``3way``.
    """
    if not patches:
        raise HarnessError("apply_alone needs at least one patch")
    forget(clone, base)
    return apply_series(clone, patches, identity, abort=True, three_way=three_way)
