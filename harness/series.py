"""Stage 2: apply ``patches/`` as commits, export commits back as ``patches/``.

Rules that keep the round trip byte-stable and the commit ids machine-independent:

* apply is ``git am --3way --keep-non-patch`` one patch at a time, with the
  pinned committer identity and ``--committer-date-is-author-date``;
* export is ``git format-patch --zero-commit --no-signature --full-index
  --numbered --base=<base>``, run with no user git configuration.

Rules that keep work from being lost:

* the tree records (:class:`Record`, in its git directory) the series hash
  and the commits of the last apply or export, so "patches/ changed since"
  and "commits that were never exported" are told apart, each with a fix
  that is safe to follow;
* apply never drops commits that exist nowhere else (uncommitted changes, a
  stopped ``git am``, commits no other branch holds), and export never drops a
  patch of ``patches/`` or a change made to it since, unless told ``--force``;
* a stopped apply is finished with ``apply --continue``, which applies the rest.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from harness.applying import (
    Outcome,
    PatchResult,
    apply_series,
    blocking,
    committer,
    scratch_tree,
)
from harness.base import materialize
from harness.patches import (
    PATCH_GLOB,
    comparable,
    comparable_on_release,
    listed_names,
    series_files,
    series_hash,
    series_listing,
)
from harness.project import HarnessError, Identity, Project, git, progress

RESET_HINT = "python -m harness reset"
CONTINUE_HINT = "python -m harness apply --continue"
SAVED_BRANCH = "series-saved"
RECORD = "harness-series.json"
BEFORE_APPLY = "refs/harness/before-apply"


# --------------------------------------------------------------------------- record


@dataclasses.dataclass(frozen=True)
class Record:
    """What the tree's ``series`` branch was made from, kept in the tree's git directory.

    ``commits[i]`` is the commit of ``patches[i]``; ``stopped`` names the patch
    a stopped apply left to resolve (the ones after it were not applied).
    """

    series_hash: str
    patches: tuple[str, ...]
    commits: tuple[str, ...]
    stopped: str | None = None

    @property
    def head(self) -> str | None:
        return self.commits[-1] if self.commits else None

    def unapplied(self) -> list[str]:
        """Patches of the recorded series after the stopped one."""
        if self.stopped is None:
            return []
        return list(self.patches[self.patches.index(self.stopped) + 1 :])


def _gitdir(tree: Path) -> Path:
    return Path(git(tree, "rev-parse", "--absolute-git-dir").stdout.strip())


def load_record(tree: Path) -> Record | None:
    path = _gitdir(tree) / RECORD
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return Record(
        series_hash=data["series_hash"],
        patches=tuple(data["patches"]),
        commits=tuple(data["commits"]),
        stopped=data.get("stopped"),
    )


def save_record(tree: Path, record: Record) -> None:
    (_gitdir(tree) / RECORD).write_text(json.dumps(dataclasses.asdict(record), indent=2) + "\n")


def _commits(tree: Path, base: str, head: str = "HEAD") -> list[str]:
    return git(tree, "rev-list", "--reverse", f"{base}..{head}").stdout.split()


# --------------------------------------------------------------------------- guards


def am_in_progress(tree: Path) -> bool:
    return (_gitdir(tree) / "rebase-apply").exists()


def ensure_clean(tree: Path) -> None:
    """Refuse a tree with a stopped ``git am`` or uncommitted changes."""
    if am_in_progress(tree):
        raise HarnessError(
            f"{tree} has a stopped `git am`. Resolve the conflict there, `git add` the "
            f"files and run `{CONTINUE_HINT}` (it applies the rest of the series), or "
            f"discard it with `{RESET_HINT}`."
        )
    status = git(tree, "status", "--porcelain", "--untracked-files=normal").stdout
    if status.strip():
        raise HarnessError(
            f"{tree} has uncommitted changes; commit them and run "
            f"`python -m harness export`, or stash them (git -C {tree} stash -u). "
            f"Nothing was changed.\n{status.rstrip()}"
        )


def matches_patches(project: Project, tree: Path, base: str) -> bool:
    """Whether the commits ``base..HEAD`` reproduce the first patches of ``patches/``.

    On another release than ``[base]``'s (``$VLLM_SERIES_VLLM``), blob ids and
    hunk line numbers are that release's and are not compared.
    """
    listed = series_files(project)
    same = comparable if project.on_default else comparable_on_release
    with tempfile.TemporaryDirectory() as tmp:
        exported = format_patches(tree, base, Path(tmp))
        return len(exported) <= len(listed) and all(
            mine.name == theirs.name and same(mine.read_bytes()) == same(theirs.read_bytes())
            for mine, theirs in zip(exported, listed, strict=False)
        )


def _held_elsewhere(tree: Path) -> list[str]:
    """Branches and tags other than ``series`` that contain ``HEAD``."""
    refs = git(
        tree, "for-each-ref", "--contains", "HEAD", "--format=%(refname:short)",
        "refs/heads", "refs/tags",
    ).stdout.split()  # fmt: skip
    return [r for r in refs if r != "series"]


def _changed_since(record: Record | None, current: str) -> bool:
    return record is not None and record.series_hash != current


def _own_commits(record: Record | None, tree: Path, base: str) -> list[str]:
    """Commits on ``series`` that the last apply or export did not make."""
    commits = _commits(tree, base)
    if record is None:
        return commits
    known = set(record.commits)
    return [c for c in commits if c not in known]


def applied_alone(project: Project, tree: Path, base: str) -> tuple[str, ...] | None:
    """The patches ``apply(only=...)`` put on the base, when the tree is still exactly that
    (same series, no other commit); None for any other tree."""
    record, names = load_record(tree), [p.name for p in series_files(project)]
    if record is None or record.stopped or list(record.patches) == names:
        return None
    if _changed_since(record, series_hash(project)) or _own_commits(record, tree, base):
        return None
    if not set(record.patches) <= set(names) or len(record.commits) != len(record.patches):
        return None
    return record.patches


def ensure_exported(project: Project, tree: Path, base: str) -> None:
    """Refuse unless the commits on ``base`` reproduce (a prefix of) ``patches/``, or
    exactly the patches that ``apply(only=...)`` put there.

    The build uses this: a wheel labelled with the series hash must be built
    from that series. The message says which side moved, and the fix for it.
    """
    if matches_patches(project, tree, base) or applied_alone(project, tree, base):
        return
    record, current = load_record(tree), series_hash(project)
    own = _own_commits(record, tree, base)
    if _changed_since(record, current) and not own:
        assert record is not None
        raise HarnessError(
            f"patches/ changed since {tree} was applied (series hash {record.series_hash}, "
            f"now {current}); run `python -m harness apply` to rebuild it. Nothing was changed."
        )
    raise HarnessError(_unexported_message(project, tree, record, current, own))


def _unexported_message(
    project: Project, tree: Path, record: Record | None, current: str, own: list[str]
) -> str:
    count = f"{len(own)} commit(s)" if own else "commits"
    keep = (
        f"`git -C {tree} branch {SAVED_BRANCH}` keeps a copy of them on another branch "
        f"(`series` stays checked out), after which apply may rebuild `series`"
    )
    if record is not None and _changed_since(record, current):
        since = record.head or project.pin.base_commit
        return (
            f"{tree} has {count} that are not in patches/, and patches/ changed since the "
            f"last apply (series hash {record.series_hash}, now {current}). Exporting would "
            f"overwrite that change and applying would drop the commits. Keep them with "
            f"`git -C {tree} branch {SAVED_BRANCH}` (`series` stays checked out), run "
            f"`python -m harness apply`, then `git -C {tree} cherry-pick "
            f"{since}..{SAVED_BRANCH}` puts them back on top. Nothing was changed."
        )
    if record is not None and record.stopped is not None:
        return (
            f"{tree} has {count} that are not in patches/, made after an apply that stopped "
            f"at {record.stopped}. Run `{CONTINUE_HINT}` to apply the rest of the series on "
            f"them, then `python -m harness export`; or set them aside: {keep}. Nothing was "
            f"changed."
        )
    if record is not None:
        return (
            f"{tree} has {count} that are not in patches/ (patches/ is unchanged since the "
            f"last apply). Run `python -m harness export` to keep them in patches/, or "
            f"set them aside: {keep}. Nothing was changed."
        )
    return (
        f"{tree} has {count} that are not in patches/ (or patches/ changed since they "
        f"were applied; this tree has no record of its last apply to tell which). {keep}; "
        f"or, if patches/ has no changes of its own, `python -m harness export` keeps "
        f"them in patches/. Nothing was changed."
    )


def ensure_nothing_lost(project: Project, tree: Path, base: str) -> None:
    """Refuse to rebuild ``series`` when that would make commits unreachable."""
    if git(tree, "rev-parse", "HEAD").stdout.strip() == base or _held_elsewhere(tree):
        return
    if matches_patches(project, tree, base):
        return
    record, current = load_record(tree), series_hash(project)
    own = _own_commits(record, tree, base)
    if record is not None and not own:
        # The tree is what the recorded series made; keep it reachable anyway.
        git(tree, "update-ref", BEFORE_APPLY, "HEAD")
        progress(
            f"patches/ changed since the last apply (series hash {record.series_hash}, now "
            f"{current}); the tree holds nothing else, rebuilding it (the previous tree "
            f"stays reachable as {BEFORE_APPLY})"
        )
        return
    raise HarnessError(_unexported_message(project, tree, record, current, own))


def _ensure_on_series(tree: Path, base_tag: str) -> None:
    branch = git(tree, "symbolic-ref", "--short", "-q", "HEAD", check=False).stdout.strip()
    if branch == "series":
        return
    exists = git(tree, "rev-parse", "-q", "--verify", "refs/heads/series", check=False)
    fix = (
        f"git -C {tree} checkout series"
        if exists.returncode == 0
        else f"git -C {tree} checkout -b series {base_tag}"
    )
    raise HarnessError(
        f"{tree} has {branch or 'a detached HEAD'} checked out, not `series`; run "
        f"`{fix}` first (nothing was changed)"
    )


# --------------------------------------------------------------------------- apply


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


def _apply_and_record(
    project: Project,
    tree: Path,
    patches: list[Path],
    done: Sequence[str],
    names: Sequence[str] | None = None,
) -> list[PatchResult]:
    """Apply ``patches`` on HEAD (after ``done``, already applied) and record the outcome
    as a tree of ``names`` (default: the whole series)."""
    names = names or [p.name for p in series_files(project)]
    results = apply_series(tree, patches, project.pin.identity, abort=False)
    stopped = next((r.patch for r in results if r.outcome is Outcome.FAILED), None)
    base = project.pin.base_commit
    commits = list(done) + _commits(tree, done[-1] if done else base)
    save_record(tree, Record(series_hash(project), tuple(names), tuple(commits), stopped))
    return results


def borrow_objects(project: Project, tree: Path) -> list[str]:
    """Fetch the ``series`` branch of every other release tree in the work area into
    ``tree`` (as ``refs/borrowed/<release>``); return the releases borrowed from.

    ``git am --3way`` falls back on the blobs a patch was made from. Patches made
    on one release and applied on another (a rebase onto a new release, or a
    backport) find those blobs in that release's tree, when it is materialized:
    without them git can only say that the repository "lacks the necessary blobs".
    """
    root = project.work if project.vllm is None else project.work.parent.parent
    trees = {project.pin.default.version: root / "vllm"}
    trees |= {p.name: p / "vllm" for p in sorted((root / "releases").glob("*"))}
    borrowed = []
    for version, other in trees.items():
        if other.resolve() == tree.resolve() or not (other / ".git").exists():
            continue
        fetched = git(
            tree, "fetch", "--no-tags", "-q", str(other),
            f"+refs/heads/series:refs/borrowed/{version}", check=False,
        )  # fmt: skip
        if fetched.returncode == 0:
            borrowed.append(version)
    return borrowed


def apply(project: Project, only: Sequence[Path] | None = None) -> list[PatchResult]:
    """``python -m harness apply``: rebuild the ``series`` branch from the base and apply.

    ``only`` applies just those patches on the base (the revision matrix builds and
    tests a commit that applies alone where the series stops earlier); the record
    then names them, so a later full ``apply`` rebuilds the tree.
    """
    tree, base = prepare(project)
    ensure_clean(tree)
    _ensure_on_series(tree, project.pin.release.tag)
    ensure_nothing_lost(project, tree, base)
    git(tree, "reset", "-q", "--hard", base)
    borrow_objects(project, tree)
    patches = list(only) if only is not None else series_files(project)
    names = [p.name for p in patches] if only is not None else None
    results = _apply_and_record(project, tree, patches, [], names)
    _raise_for(results, stopped=True)
    return results


def _author_date(tree: Path) -> str:
    """The author date of the patch a stopped ``git am`` is applying."""
    script = (_gitdir(tree) / "rebase-apply" / "author-script").read_text()
    match = re.search(r"^GIT_AUTHOR_DATE='([^']*)'", script, re.M)
    if not match:
        raise HarnessError("the stopped git am has no author date")
    return match.group(1)


def continue_apply(project: Project) -> list[PatchResult]:
    """``python -m harness apply --continue``: finish a stopped apply, then apply the rest.

    The stopped ``git am`` is continued with the pinned committer and the
    patch's author date as commit date (plain ``git am --continue`` would use
    the clock); when it was already continued by hand, the rest is applied on
    what it committed.
    """
    tree, base = prepare(project)
    record = load_record(tree)
    if record is None or record.stopped is None:
        raise HarnessError(
            "nothing to continue: the last apply did not stop; run `python -m harness apply`"
        )
    current = series_hash(project)
    if record.series_hash != current:
        raise HarnessError(
            f"patches/ changed since the apply that stopped at {record.stopped} (series hash "
            f"{record.series_hash}, now {current}). Finish the stopped `git am` by hand "
            f"(`git -C {tree} am --continue`) and run `python -m harness apply`, which says "
            f"how to keep what you resolved on top of the new patches/; or discard it with "
            f"`{RESET_HINT}`"
        )
    if am_in_progress(tree):
        env = {**committer(project.pin.identity), "GIT_COMMITTER_DATE": _author_date(tree)}
        done = git(tree, "am", "--continue", env=env, check=False)
        if done.returncode != 0:
            raise HarnessError(
                f"git am --continue failed in {tree}; resolve the conflicts, `git add` the "
                f"files and run `{CONTINUE_HINT}` again, or `{RESET_HINT}`.\n"
                + (done.stdout + done.stderr).strip()
            )
    ensure_clean(tree)
    applied = list(record.commits)
    if applied and applied[-1] not in [*_commits(tree, base), base]:
        raise HarnessError(
            f"{tree} no longer holds the commits the stopped apply made; nothing to continue"
        )
    done_commits = _commits(tree, base)
    resolved = done_commits[len(applied) :]
    rest = [project.patches / name for name in record.unapplied()]
    progress(
        f"{record.stopped}: "
        + ("resolved" if resolved else "skipped (no commit was made for it)")
        + f"; applying {len(rest)} more"
    )
    results = _apply_and_record(project, tree, rest, done_commits)
    _raise_for(results, stopped=True)
    return results


def _raise_for(results: Sequence[PatchResult], *, stopped: bool) -> None:
    result = blocking(results)
    if result is None:
        return
    if result.outcome is Outcome.FAILED:
        hint = (
            f"\nThe tree is left at the stopped `git am`: resolve it there, `git add` the "
            f"files and run `{CONTINUE_HINT}`; `{RESET_HINT}` returns it to the base."
            if stopped
            else ""
        )
        raise HarnessError(result.detail + hint)
    raise HarnessError(
        f"{result.patch} is already upstream in this base ({result.detail}); drop it "
        f"from patches/series."
    )


def reset(project: Project) -> None:
    """``python -m harness reset``: abort a stopped apply and return ``series`` to the base."""
    tree, base = prepare(project)
    if am_in_progress(tree):
        progress("aborting the stopped git am")
        git(tree, "am", "--abort", env=committer(project.pin.identity))
    ensure_clean(tree)
    branch = git(tree, "symbolic-ref", "--short", "-q", "HEAD", check=False).stdout.strip()
    if branch != "series":
        has_series = git(tree, "rev-parse", "-q", "--verify", "refs/heads/series", check=False)
        if has_series.returncode == 0:
            # Back to `series` first, so its commits get the same protection.
            git(tree, "checkout", "-q", "series")
    if git(tree, "rev-parse", "-q", "--verify", "refs/heads/series", check=False).returncode == 0:
        ensure_nothing_lost(project, tree, base)
    git(tree, "checkout", "-q", "-B", "series", base)
    save_record(tree, Record(series_hash(project), (), ()))


# --------------------------------------------------------------------------- export


def format_patches(
    tree: Path, base: str, out: Path, *, signoff: Identity | None = None, cover: bool = False
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
    if cover:
        args.append("--cover-letter")
    env = None
    if signoff is not None:
        args.append("--signoff")
        env = {"GIT_COMMITTER_NAME": signoff.name, "GIT_COMMITTER_EMAIL": signoff.email}
    names = git(tree, *args, f"{base}..HEAD", env=env).stdout.split()
    return [Path(n) for n in names]


def _diff_part(text: bytes) -> bytes:
    """A patch's change without its message: from the first ``diff --git`` on."""
    start = text.find(b"\ndiff --git ")
    return comparable(text[start:]) if start >= 0 else b""


def _uncommitted_patch_files(project: Project) -> list[str]:
    """Patch files and ``patches/series`` with changes the project's git has not committed."""
    inside = git(project.root, "rev-parse", "--is-inside-work-tree", check=False)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return []
    status = git(
        project.root, "status", "--porcelain", "--untracked-files=all", "--", "patches"
    ).stdout.splitlines()
    names = [line[3:] for line in status]
    return [n for n in names if n.endswith((".patch", "/series"))]


def _export_refusals(project: Project, tree: Path, written: list[Path]) -> list[str]:
    """What regenerating ``patches/`` from ``written`` would lose (empty: nothing)."""
    problems = []
    record, current = load_record(tree), series_hash(project)
    if record is not None and record.stopped is not None:
        problems.append(
            f"the last apply stopped at {record.stopped}, so the tree lacks "
            f"{', '.join(record.unapplied()) or 'no later patch'}; run `{CONTINUE_HINT}` "
            f"to apply the rest"
        )
    if _changed_since(record, current):
        assert record is not None
        problems.append(
            f"patches/ changed since the last apply (series hash {record.series_hash}, now "
            f"{current}, for example by a pull); exporting would replace that change with "
            f"the tree's older commits. Run `python -m harness apply` first (it says how to "
            f"keep commits of your own)"
        )
    elif record is None and (dirty := _uncommitted_patch_files(project)):
        problems.append(
            "patches/ has changes that are not committed and that this tree did not "
            f"produce: {', '.join(dirty)}"
        )
    new = {_diff_part(p.read_bytes()) for p in written}
    new_names = {p.name for p in written}
    gone = [
        p.name
        for p in series_files(project)
        if p.name not in new_names and _diff_part(p.read_bytes()) not in new
    ]
    if gone and not problems:
        problems.append(
            "the tree has no commit for " + ", ".join(gone) + "; export would delete them"
        )
    return problems


def _check_out_dir(project: Project, out: Path) -> None:
    """A submission copy goes to its own folder, and leaves nothing stale there."""
    if out.resolve() == project.patches.resolve():
        raise HarnessError(
            "--out is patches/: a submission copy never replaces the canonical patches; "
            "give another folder"
        )
    if not out.exists():
        return
    ours = {"series", "0000-cover-letter.patch"}
    stray = sorted(p.name for p in out.iterdir() if not (p.name in ours or p.match(PATCH_GLOB)))
    if stray:
        raise HarnessError(
            f"{out} holds files export did not write ({', '.join(stray)}); give an empty "
            f"or new folder"
        )
    for old in out.iterdir():
        old.unlink()


def upstream_base(project: Project, tree: Path) -> str:
    """The release's upstream commit as its sdist records it (``vllm/_version.py``)."""
    tag = project.pin.release.tag
    shown = git(tree, "show", f"{tag}:vllm/_version.py", check=False)
    match = re.search(r"commit_id = '(?:g)?([0-9a-f]+)'", shown.stdout)
    return match.group(1) if match else ""


def _submission(project: Project, tree: Path, written: list[Path], author: Identity | None) -> None:
    """Rewrite a submission copy: the submitter as author, upstream's base in place of ours."""
    pin = project.pin
    upstream = upstream_base(project, tree)
    full = len(upstream) == 40
    for path in written:
        text = path.read_text()
        head, sep, body = text.partition("\n\n")
        if author is not None:
            sender = f"From: {author.name} <{author.email}>"
            head = re.sub(r"(?m)^From: .*(?:\n[ \t].*)*$", sender, head)
        text = head + sep + body
        if full:
            text = text.replace(f"base-commit: {pin.base_commit}", f"base-commit: {upstream}")
        else:
            text = re.sub(rf"\nbase-commit: {pin.base_commit}\n", "\n", text)
        if path.name == "0000-cover-letter.patch":
            where = (
                f"Based on vLLM {pin.release.version} (tag {pin.release.tag}, upstream "
                f"commit {upstream})."
                if full
                else f"Based on vLLM {pin.release.version}, tag {pin.release.tag} (upstream "
                f"commit {upstream or 'unknown'}: its sdist records only this short id, so "
                f"the patches carry no base-commit line)."
            )
            text = text.replace(
                "*** BLURB HERE ***", "*** BLURB HERE ***\n\n" + textwrap.fill(where, 72), 1
            )
            if author is not None:  # the shortlog groups by the commits' (project) author
                text = re.sub(
                    rf"(?m)^{re.escape(pin.identity.name)} (\(\d+\):)$", rf"{author.name} \1", text
                )
        path.write_text(text)


def export(
    project: Project,
    *,
    signoff: Identity | None = None,
    author: Identity | None = None,
    out: Path | None = None,
    force: bool = False,
) -> list[Path]:
    """``python -m harness export``: regenerate ``patches/`` (or ``out``) from the tree.

    Regenerating ``patches/`` refuses, unless ``force``, when it would lose
    something: patches of a stopped apply that were never applied, a change
    made to ``patches/`` since the tree was applied, or a listed patch the
    tree has no commit for. With ``signoff`` or ``author`` it writes a
    submission copy instead, which must go to ``out`` (never ``patches/``): the
    submitter's ``Signed-off-by`` and ``From:``, a cover letter, and the
    release's upstream commit in place of the synthetic base.
    """
    if (signoff is not None or author is not None) and out is None:
        raise HarnessError("--signoff and --author write a submission copy: give it --out DIR")
    tree, base = prepare(project)
    ensure_clean(tree)
    if out is not None:
        record = load_record(tree)
        if record is not None and record.stopped is not None and not force:
            raise HarnessError(
                f"the last apply stopped at {record.stopped}; the tree lacks "
                f"{', '.join(record.unapplied())}. Run `{CONTINUE_HINT}` first (or --force)"
            )
        _check_out_dir(project, out)
        written = format_patches(tree, base, out, signoff=signoff, cover=True)
        _submission(project, tree, written, author)
        patches = [p.name for p in written if p.name != "0000-cover-letter.patch"]
        (out / "series").write_text(series_listing(patches))
        progress(f"exported a submission copy of {len(patches)} patch(es) to {out}")
        return written
    with _staged(project) as staging:
        written = format_patches(tree, base, staging)
        if not force and (problems := _export_refusals(project, tree, written)):
            raise HarnessError(
                "export would lose work, so patches/ was left as it is:\n- "
                + "\n- ".join(problems)
                + "\n(`python -m harness export --force` writes the tree's commits anyway.)"
            )
        for old in project.patches.glob(PATCH_GLOB):
            old.unlink()
        final = []
        for path in written:
            shutil.move(str(path), project.patches / path.name)
            final.append(project.patches / path.name)
    (project.patches / "series").write_text(series_listing([p.name for p in final]))
    save_record(
        tree,
        Record(series_hash(project), tuple(p.name for p in final), tuple(_commits(tree, base))),
    )
    progress(f"exported {len(final)} patch(es) to {project.patches}")
    return final


@contextmanager
def _staged(project: Project) -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="harness-export-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- range-diff


def _patches_at(project: Project, revision: str, dest: Path) -> list[Path]:
    """The series of ``patches/`` as committed at project ``revision``, written into ``dest``."""
    listing = git(project.root, "show", f"{revision}:patches/series", check=False)
    if listing.returncode != 0:
        raise HarnessError(f"no patches/series at {revision}: {listing.stderr.strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "series").write_text(listing.stdout)
    files = []
    for name in listed_names(dest):
        shown = git(project.root, "show", f"{revision}:patches/{name}")
        (dest / name).write_text(shown.stdout)
        files.append(dest / name)
    return files


def range_diff(project: Project, old: str = "HEAD", new: str = "tree") -> str:
    """``python -m harness range-diff``: ``git range-diff`` between two versions of the series.

    Each side is ``tree`` (the tree's ``series`` branch), ``patches`` (patches/
    as it is on disk), or a revision of this repository (its committed
    patches/). The default compares the committed series with the tree, the
    review of a new version before it is exported.
    """
    tree, base = prepare(project)
    with (
        tempfile.TemporaryDirectory() as tmp,
        _side(project, tree, base, old, Path(tmp) / "old") as a,
        _side(project, tree, base, new, Path(tmp) / "new") as b,
    ):
        return git(tree, "range-diff", "--no-color", f"{base}..{a}", f"{base}..{b}").stdout


@contextmanager
def _side(project: Project, tree: Path, base: str, spec: str, tmp: Path) -> Iterator[str]:
    if spec == "tree":
        yield git(tree, "rev-parse", "refs/heads/series").stdout.strip()
        return
    files = series_files(project) if spec == "patches" else _patches_at(project, spec, tmp)
    with scratch_tree(tree, base) as work:
        results = apply_series(work, files, project.pin.identity, abort=True)
        if (stop := blocking(results)) is not None:
            raise HarnessError(f"the series at {spec} does not apply: {stop.detail}")
        yield git(work, "rev-parse", "HEAD").stdout.strip()
