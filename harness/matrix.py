"""The revision matrix: how each commit of the series meets other vLLM releases.

For every release in ``patches/base.toml`` (``[[matrix]]`` plus the base
itself), each patch of that release's own series (``patches/``, or the
backport folder its ``series`` key names) is applied after the prerequisites
its note names, in a fresh clone whose objects are only that release's and
those of the release the series is made on (what an upstream clone has; never
the series' own blobs), and classified:
``clean``, ``3way``, ``rebase`` (with the failing files), ``upstream``
(already there), or ``blocked`` when a prerequisite already failed; a patch
the release's series lacks is ``absent``. Each cell records how long its apply
took, and the JSON records the series (folder and hash) each release ran,
which ``python -m harness check`` compares with the committed series.

With ``--test`` (:func:`run_matrix` ``test=True``), every release on which
the whole series applies then runs the normal pipeline in its own work area
(``<work>/releases/<version>``, the one ``$VLLM_SERIES_VLLM`` selects): apply,
the python-only build (``--stock-kernels``) and the series' CPU tests. Each
cell gains a ``build`` and a ``test`` entry: ``passed``, ``failed`` (with the
first failing test, or the build's error), or ``not run`` with the reason
(the patch did not apply, or the series stops earlier on that release). Where
the series stops, a later commit that stands on the bare base and applies alone
is built and tested alone on it instead. On the base the series is made on,
each prefix that ends at a commit of a stack (``stack`` in the commit's note)
is first applied, built and tested on its own (:func:`run_prefixes`). The
build is one wheel per release, so its time is the release's; a cell's test
time is the sum of its own test files' cases. The JSON lands in
``results/matrix.json`` and SERIES.md renders it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness import build, document, pinning, results, series, test
from harness.applying import apply_alone, base_store, fresh_clone
from harness.base import materialize
from harness.patches import load_notes, patch_tests, series_files, series_record
from harness.project import HarnessError, Project, Release, git, progress

APPLIED = ("clean", "3way")


def classify(project: Project, release: Release) -> dict[str, dict[str, Any]]:
    """One column of the matrix: ``{patch: {"outcome": ..., "files": [...], "seconds": ...}}``.

    The release's own series is classified: ``patches/`` or the backport folder
    its pin names (``series = "0.33.0"``).
    """
    pin = project.pin
    selected = project.series_for(release.version)
    home = project.for_release(selected.pin.home)
    home_tree, _ = series.prepare(home)
    # The blobs of the release the series is made on: git am's 3-way fallback
    # then works as it does in an upstream clone that has both releases.
    sources = [(home_tree, home.pin.release.tag)]
    if release.version == home.pin.release.version:
        base = home.pin.base_commit
    else:
        # The release's own tree (the one `VLLM_SERIES_VLLM` uses), only its tag is read.
        tree = project.release_work(release.version) / "vllm"
        base = materialize(project, release, tree, pin.identity)
        sources.insert(0, (tree, release.tag))
    patches = series_files(selected)
    notes = load_notes(selected)
    cells: dict[str, dict[str, Any]] = {}
    with base_store(sources) as store, fresh_clone(store, base) as clone:
        for patch in patches:
            prereqs = [patches[i - 1] for i in notes[patch.name].requires]
            started = time.monotonic()
            applied = apply_alone(clone, base, [*prereqs, patch], pin.identity, three_way=True)
            seconds = round(time.monotonic() - started, 1)
            last = applied[-1]
            if last.patch != patch.name:
                cells[patch.name] = {"outcome": "blocked", "files": [last.patch]}
            else:
                cells[patch.name] = {"outcome": last.outcome.value, "files": list(last.files)}
            cells[patch.name]["seconds"] = seconds
            progress(f"{release.version}: {patch.name}: {cells[patch.name]['outcome']}")
    return cells


def _not_run(reason: str) -> dict[str, Any]:
    return {"result": "not run", "detail": reason, "seconds": 0.0}


def _no_tests() -> dict[str, Any]:
    """The test cell of a patch that adds or changes no test file."""
    return {"result": "no tests", "detail": "", "seconds": 0.0}


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def cell_tests(
    patches: Sequence[Path], cases: Sequence[test.Case], deselected: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """Each patch's test result from one run's cases: its own test files' cases only.

    ``failed`` names the first failing case; a patch that adds or changes no
    test file reads ``no tests``; tests the release's pin deselects are counted.
    """
    out: dict[str, dict[str, Any]] = {}
    for patch in patches:
        files = set(patch_tests(patch))
        mine = [c for c in cases if c.file in files]
        seconds = round(sum(c.seconds for c in mine), 1)
        bad = [c for c in mine if c.outcome in ("failed", "error")]
        if not files:
            out[patch.name] = _no_tests()
        elif bad:
            out[patch.name] = {"result": "failed", "detail": bad[0].test_id, "seconds": seconds}
        elif not mine:
            out[patch.name] = {"result": "failed", "detail": "none of its tests ran",
                               "seconds": 0.0}  # fmt: skip
        else:
            passed = sum(c.outcome == "passed" for c in mine)
            skipped = sum(c.outcome == "skipped" for c in mine)
            detail = f"{passed} passed, {skipped} skipped"
            if dropped := sum(d.split("::", 1)[0] in files for d in deselected):
                detail += f", {dropped} deselected (patches/base.toml)"
            out[patch.name] = {"result": "passed", "detail": detail, "seconds": seconds}
    return out


def run_release(project: Project, version: str, cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Apply, build and test the series on ``version`` in its own work area; fill ``cells``.

    Returns the release's run: ``{"apply"|"build"|"test": {"result", "detail", "seconds"}}``.
    Where the series stops, nothing of it runs, but each later commit that stands on
    the bare base (no prerequisite in its note) and applied alone in :func:`classify`
    is applied, built and tested alone on the base: ``run["alone"][patch]``.
    """
    patches = series_files(project.series_for(version))
    stop = next((p for p in patches if cells[p.name]["outcome"] not in APPLIED), None)
    if stop is None:
        prefixes = run_prefixes(project, version) if version == project.pin.release.version else {}
        full = _run_group(project, version, cells)
        return full | {"prefixes": prefixes} if prefixes else full
    reason = f"the series stops at {stop.name[:4]} on this release"
    for patch in patches:
        applied = cells[patch.name]["outcome"] in APPLIED
        why = reason if applied else "the patch did not apply"
        cells[patch.name] |= {"build": _not_run(why), "test": _not_run(why)}
    run: dict[str, Any] = {name: _not_run(reason) for name in ("apply", "build", "test")}
    notes = load_notes(project.series_for(version))
    after = patches[patches.index(stop) + 1 :]
    alone = [p for p in after if not notes[p.name].requires and cells[p.name]["outcome"] in APPLIED]
    if alone:
        run["alone"] = {p.name: _run_group(project, version, cells, [p]) for p in alone}
    return run


def run_prefixes(project: Project, version: str) -> dict[str, dict[str, Any]]:
    """Each prefix of the series that ends at a commit of a stack (``stack`` in its note),
    applied, built and tested alone on the base of ``version``: ``{last patch: steps}``.

    A stack's commits are reviewed, and may be cherry-picked, one at a time, so each
    must build and pass the tests with only the commits before it. The steps are
    :func:`_run_group`'s, plus ``own``: the result of the last commit's own tests.
    The series' last commit is left out: the full run is that prefix. Run before the
    full run, which then leaves the release's tree as the whole series.
    """
    patches = series_files(project.series_for(version))
    notes = load_notes(project.series_for(version))
    out: dict[str, dict[str, Any]] = {}
    for i, patch in enumerate(patches[:-1]):
        if notes[patch.name].stack:
            scratch: dict[str, dict[str, Any]] = {p.name: {} for p in patches[: i + 1]}
            steps = _run_group(project, version, scratch, patches[: i + 1], label="prefix")
            out[patch.name] = steps | {"own": scratch[patch.name]["test"]}
    return out


def failures(data: dict[str, Any]) -> list[str]:
    """The failed steps of a matrix run, e.g. ``0.32.0 test``, ``0.31.0 0005 alone build``
    or ``0.34.0 prefix to 0003 own``."""
    out = []
    for version, run in data.get("runs", {}).items():
        groups = [("", run)] + [(f" {p[:4]} alone", r) for p, r in run.get("alone", {}).items()]
        groups += [(f" prefix to {p[:4]}", r) for p, r in run.get("prefixes", {}).items()]
        for label, steps in groups:
            out += [f"{version}{label} {step}" for step in ("apply", "build", "test", "own")
                    if steps.get(step, {}).get("result") == "failed"]  # fmt: skip
    return out


def _run_group(
    project: Project,
    version: str,
    cells: dict[str, dict[str, Any]],
    only: Sequence[Path] | None = None,
    label: str = "alone",
) -> dict[str, Any]:
    """Apply the whole series (or ``only`` those patches, alone on the base: a commit
    ``"alone"`` or a ``"prefix"``), build and test; fill the applied patches' cells and
    return the run's steps."""
    release = project.for_release(version)
    patches = list(only) if only else series_files(release)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("apply", lambda: series.apply(release, only)),
        ("build", lambda: build.build(release, stock_kernels=True)),
        ("test", lambda: test.run_tests(release)),
    ]
    title = f"{version} ({only[-1].name[:4]} {label})" if only else version
    run: dict[str, Any] = {}
    report: test.TestReport | None = None
    for name, step in steps:
        if any(r["result"] != "passed" for r in run.values()):
            run[name] = _not_run(f"{list(run)[-1]} failed")
            continue
        progress(f"{title}: {name}")
        started = time.monotonic()
        try:
            outcome = step()
        except HarnessError as exc:
            run[name] = {"result": "failed", "detail": _first_line(exc)}
        else:
            run[name] = {"result": "passed", "detail": ""}
            if isinstance(outcome, test.TestReport):
                report = outcome
                run[name] = {"result": "passed" if outcome.ok else "failed",
                             "detail": outcome.summary()}  # fmt: skip
        run[name]["seconds"] = round(time.monotonic() - started, 1)
    if report is not None and test.junit_path(release).exists():
        per_test = cell_tests(
            patches,
            test.junit_cases(test.junit_path(release)),
            [test_id for test_id, _ in release.pin.deselect],
        )
    else:  # tests that ran but wrote no report collected nothing: "no tests" stays so
        why = run["test"]["detail"] or "tests not run"
        per_test = {
            p.name: _no_tests() if report is not None and not patch_tests(p) else _not_run(why)
            for p in patches
        }
    for patch in patches:
        build_cell = {k: run["build"][k] for k in ("result", "detail")}
        if only and build_cell["result"] == "passed":
            build_cell["detail"] = f"{label} on the base"
        build_cell["seconds"] = run["build"]["seconds"]
        cells[patch.name] |= {"build": build_cell, "test": per_test[patch.name]}
    return run


def run_matrix(project: Project, *, test_releases: bool = False) -> dict[str, Any]:
    """``python -m harness matrix [--test]``: classify (and run) every release; write the JSON."""
    pin = project.pin
    releases = list(pin.releases)
    columns: dict[str, dict[str, dict[str, Any]]] = {}
    runs: dict[str, dict[str, Any]] = {}
    for release in releases:
        started = time.monotonic()
        columns[release.version] = classify(project, release)
        if test_releases:
            runs[release.version] = run_release(project, release.version, columns[release.version])
        progress(f"{release.version}: done in {time.monotonic() - started:.0f} s")
    names = [p.name for p in series_files(project)]
    names += sorted({n for c in columns.values() for n in c} - set(names))
    absent = {"outcome": "absent", "files": []}
    data: dict[str, Any] = {
        "git": git(project.root, "--version").stdout.strip(),
        "versions": [r.version for r in releases],
        "series": series_record(project),
        "rows": [
            {"patch": n, "cells": {v: columns[v].get(n, absent) for v in columns}} for n in names
        ],
    }
    if test_releases:
        data["runs"] = runs
    try:
        data["newer_on_index"] = pinning.newer_releases(project)
    except HarnessError as exc:
        progress(f"could not list the index's releases: {_first_line(exc)}")
    command = "nox -s matrix -- --test" if test_releases else "nox -s matrix"
    results.write(
        project.results / "matrix.json", "revision-matrix", data, results.provenance(command)
    )
    document.update(project)
    return data
