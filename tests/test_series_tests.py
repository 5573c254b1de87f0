"""Stage 4: the CPU tier runs in pytest-xdist workers, the GPU tier in one process."""

from __future__ import annotations

import os

import pytest

from harness import test


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 2), (64, test.MAX_WORKERS)])
def test_without_a_gpu_each_usable_cpu_runs_a_worker(cpus, workers, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert test.pytest_workers("none") == workers


def test_on_a_gpu_host_the_tests_run_in_pytest_s_own_process():
    assert test.pytest_workers("NVIDIA H200") == 0
