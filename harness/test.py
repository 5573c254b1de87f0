"""Stage 4: run the tests the series adds or touches, against the built wheel.

The tests come from the patched tree, copied next to (not into) the venv, so
``import vllm`` resolves to the installed wheel and ``import tests...`` to the
copy. The same command serves both tiers: vLLM's own ``current_platform``
checks skip GPU tests on hosts without one, and the report counts those skips,
with their reasons, apart from passes. On a host without a GPU the CPU tier
runs with ``VLLM_TARGET_DEVICE=cpu``: the release wheel is a CUDA build, and
without that setting vLLM cannot infer a device for the config objects the
CPU tests build ("Failed to infer device type").

Without a GPU the tests run in pytest-xdist workers, one per CPU the harness
may use (at most :data:`MAX_WORKERS`): the same tests, outcomes and JUnit
report as in one process, in less time. On a GPU host they run in pytest's own
process, as vLLM's GPU tests expect the GPU to themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from harness import build, results, series, venv
from harness.project import HarnessError, Project, git, progress
from harness.touched import touched_tests


@dataclasses.dataclass(frozen=True)
class TestReport:
    """Counts from one pytest run, with each skip's reason."""

    tests: tuple[str, ...]
    passed: int
    failed: int
    errors: int
    skipped: tuple[tuple[str, str], ...]  # (test id, reason)
    gpu: str  # the GPU pytest ran on, or "none"
    # (pytest node id, reason): not run on this release, from patches/base.toml
    deselected: tuple[tuple[str, str], ...] = ()

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.errors == 0

    def summary(self) -> str:
        return (
            f"series tests: {self.passed} passed, {self.failed} failed, "
            f"{self.errors} errors, {len(self.skipped)} skipped"
            + (f", {len(self.deselected)} deselected" if self.deselected else "")
            + f" (GPU: {self.gpu})"
        )


def parse_junit(path: Path, tests: tuple[str, ...], gpu: str) -> TestReport:
    """Read pytest's JUnit XML into a :class:`TestReport`."""
    passed = failed = errors = 0
    skipped: list[tuple[str, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next(iter(case), None)
        if outcome is None or outcome.tag in ("system-out", "system-err", "properties"):
            passed += 1
        elif outcome.tag == "skipped":
            skipped.append((name, outcome.get("message", "")))
        elif outcome.tag == "failure":
            failed += 1
        elif outcome.tag == "error":
            errors += 1
    return TestReport(tests, passed, failed, errors, tuple(skipped), gpu)


def junit_path(project: Project) -> Path:
    """Where :func:`run_tests` leaves pytest's JUnit report."""
    return project.work / "test-report.xml"


@dataclasses.dataclass(frozen=True)
class Case:
    """One test case of a JUnit report: its file, its id, what happened and how long it took."""

    file: str
    test_id: str
    outcome: str  # "passed", "failed", "error" or "skipped"
    seconds: float


def junit_cases(path: Path) -> list[Case]:
    """Every test case of pytest's JUnit XML, with the test file it came from."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        outcome = next(iter(case), None)
        tag = "passed" if outcome is None or outcome.tag in _OUTPUT_TAGS else outcome.tag
        # "tests.kernels.moe.test_x" (or "...test_x.TestClass"): the module's file
        parts = classname.split(".")
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        file = "/".join(parts) + ".py" if parts else classname
        cases.append(
            Case(
                file=file,
                test_id=f"{file}::{case.get('name')}",
                outcome={"failure": "failed"}.get(tag, tag),
                seconds=float(case.get("time") or 0.0),
            )
        )
    return cases


_OUTPUT_TAGS = ("system-out", "system-err", "properties")

# The most pytest-xdist workers the CPU tier starts: each imports vLLM and torch
# anew (about 20 s of CPU and 1.2 GiB), and one test, the Triton interpreter's
# run of the pool's kernels, takes about two minutes in whichever worker has it.
MAX_WORKERS = 4


def pytest_workers(gpu: str) -> int:
    """pytest-xdist workers for the series' tests; 0 (pytest's own process) on a GPU host.

    Without a GPU, one per CPU this process may run on (its affinity, which a
    container limits, unlike ``-n auto``'s count of the host's cores), at most
    :data:`MAX_WORKERS`.
    """
    return 0 if gpu != "none" else min(len(os.sched_getaffinity(0)), MAX_WORKERS)


def run_tests(project: Project, pytest_args: list[str] | None = None) -> TestReport:
    """``python -m harness test``: pytest over the series' tests, from the patched tree."""
    tree, base = series.prepare(project)
    series.ensure_clean(tree)
    info = build.built(project)
    head = git(tree, "rev-parse", "HEAD").stdout.strip()
    if info.tree_commit != head:
        raise HarnessError(
            "the built wheel is from another commit of the tree; run `python -m harness build`"
        )
    tests = tuple(touched_tests(tree, base))
    gpu, _ = results.gpu_and_driver()
    if not tests:
        report = TestReport(tests, 0, 0, 0, (), gpu)
        progress("the series adds or changes no tests; nothing to run")
        return report
    python = venv.install_wheel(project, info.wheel, info.wheel_sha256)
    rundir = project.work / "testrun"
    # tests/ and pyproject.toml (pytest markers) only: `vllm` must come from the wheel
    build.snapshot(tree, rundir, ("tests", "pyproject.toml"))
    junit = junit_path(project)
    deselected = project.pin.deselect
    for test_id, why in deselected:
        progress(f"deselected on vLLM {project.pin.release.version}: {test_id}: {why}")
    junit.unlink(missing_ok=True)  # a report from an earlier run must not stand for this one
    workers = pytest_workers(gpu)
    progress(f"running {len(tests)} test file(s) on GPU: {gpu}, in {workers or 'no'} worker(s)")
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-rs",
            "-q",
            f"--junitxml={junit}",
            f"--numprocesses={workers}",
            *(f"--deselect={test_id}" for test_id, _ in deselected),
            *tests,
            *(pytest_args or []),
        ],
        cwd=rundir,
        env={**os.environ, **({"VLLM_TARGET_DEVICE": "cpu"} if gpu == "none" else {})},
        check=False,
    )
    if proc.returncode == 5 and pytest_args:
        raise HarnessError(f"no test of the series matched the pytest arguments {pytest_args}")
    if proc.returncode not in (0, 1) or not junit.exists():
        raise HarnessError(f"pytest could not run the series' tests (exit {proc.returncode})")
    report = dataclasses.replace(parse_junit(junit, tests, gpu), deselected=deselected)
    (project.work / "test-report.json").write_text(
        json.dumps(dataclasses.asdict(report), indent=2) + "\n"
    )
    return report
