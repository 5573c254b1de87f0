"""``python -m harness check``: what the repository claims about the series, verified.

* the round trip: the series applied in a clone of the bare base and
  exported again reproduces ``patches/`` byte for byte;
* every patch is authored and signed off by the pinned identity;
* every commit applies alone, with plain ``git am --keep-non-patch`` (no
  3-way merge), on the base its note names, in a clone that holds only the
  base's objects: what a fork that cherry-picks the commit has;
* the same for every backport series (``patches/<release>/``) on its own
  release;
* every result file is well-formed, ``results/matrix.json`` was made from the
  committed series, and the documents' generated blocks are current.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from harness import document, results
from harness.applying import (
    Outcome,
    apply_alone,
    apply_series,
    base_store,
    blocking,
    forget,
    fresh_clone,
)
from harness.patches import load_notes, series_files, series_label, series_record
from harness.project import Project
from harness.series import format_patches, prepare


def check_round_trip(project: Project, clone: Path, base: str) -> list[str]:
    """Apply the series in ``clone`` (of the bare base), export it, compare with patches/."""
    problems = []
    patches = series_files(project)
    with tempfile.TemporaryDirectory() as tmp:
        forget(clone, base)
        applied = apply_series(clone, patches, project.pin.identity, abort=True)
        if (stop := blocking(applied)) is not None:
            if stop.outcome is Outcome.UPSTREAM:
                return [f"{stop.patch} is already upstream in this base ({stop.detail})"]
            return [stop.detail]
        out = Path(tmp)
        written = format_patches(clone, base, out)
        if [p.name for p in written] != [p.name for p in patches]:
            problems.append(f"export names {[p.name for p in written]} differ from patches/series")
        for patch in patches:
            regenerated = out / patch.name
            if regenerated.exists() and regenerated.read_bytes() != patch.read_bytes():
                problems.append(f"{patch.name} does not round-trip byte for byte")
    return problems


def where(requires: tuple[int, ...]) -> str:
    """How SERIES.md names the base a commit applies alone on."""
    return "the bare base" if not requires else "base + " + ", ".join(f"{i:04d}" for i in requires)


def check_standalone(project: Project, clone: Path, base: str) -> list[str]:
    """Apply each patch alone on the base its note names (bare base, or base + prerequisites).

    Notes are matched to patches by name, never by position.
    """
    problems = []
    patches = series_files(project)
    notes = load_notes(project)
    for patch in patches:
        note = notes[patch.name]
        prereqs = [patches[i - 1] for i in note.requires]
        applied = apply_alone(clone, base, [*prereqs, patch], project.pin.identity, three_way=False)
        last = applied[-1]
        if last.patch != patch.name or last.outcome in (Outcome.FAILED, Outcome.UPSTREAM):
            detail = last.detail if last.patch == patch.name else f"{last.patch} does not apply"
            problems.append(
                f"{patch.name} does not apply alone (git am, no 3-way) on "
                f"{where(note.requires)}: {detail}"
            )
    return problems


def stale_record(project: Project) -> list[str]:
    """How ``results/matrix.json`` differs from the committed series (empty: current).

    ``check`` uses this: a matrix made from other patches, or on other releases
    than ``patches/base.toml`` pins, no longer says what the series does.
    """
    path = project.results / "matrix.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())["data"]
    made = data.get("series")
    if made is None:
        return ["results/matrix.json records no series per release; run `nox -s matrix -- --test`"]
    problems = []
    for version, now in series_record(project).items():
        then = made.get(version)
        if then is None:
            problems.append(f"results/matrix.json has no column for vLLM {version}")
        elif then != now:
            problems.append(
                f"results/matrix.json was made on vLLM {version} from {then['series']} at "
                f"series hash {then['hash']}, but the committed {now['series']} is {now['hash']}; "
                f"run `nox -s matrix -- --test`"
            )
    return problems


def check_authorship(project: Project) -> list[str]:
    """Every patch of the selected series is authored by the pinned identity and signed
    off by it (vLLM's DCO; a submitter's own sign-off is added by ``export --out``)."""
    identity = project.pin.identity
    author = f"{identity.name} <{identity.email}>"
    problems = []
    for patch in series_files(project):
        text = patch.read_text(errors="replace")
        header = text.split("\n\n", 1)[0].replace("\n ", " ")  # unfold wrapped fields
        found = re.search(r"^From: (.*)$", header, re.M)
        if found is None or " ".join(found.group(1).split()) != author:
            got = found.group(1) if found else "none"
            problems.append(f"{patch.name}: author {got!r}, not the pinned {author!r}")
        message = text.split("\n---\n", 1)[0]
        if identity.signoff not in message.splitlines():
            problems.append(f"{patch.name}: no {identity.signoff!r} line")
    return problems


def check_series(project: Project) -> list[str]:
    """Round trip, authorship and standalone commits of the selected release's series."""
    tree, base = prepare(project)
    with base_store([(tree, project.pin.release.tag)]) as store, fresh_clone(store, base) as clone:
        problems = check_round_trip(project, clone, base)
        problems += check_authorship(project)
        problems += check_standalone(project, clone, base)
    if project.vllm is None:
        return problems
    return [f"{series_label(project)}: {p}" for p in problems]


def check(project: Project) -> list[str]:
    """Round trip and standalone commits of the main series and of every backport,
    result files, the matrix's series, fresh documents."""
    problems = check_series(project)
    for backport in project.backports():
        problems += check_series(backport)
    problems += results.check_all(project.root)
    problems += stale_record(project)
    problems += [
        f"{name}: generated blocks are stale; run `python -m harness doc`"
        for name in document.stale(project)
    ]
    problems += document.guide_drift(project)
    return problems
