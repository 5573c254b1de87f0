"""scripts/planner_race_check.py compares only table entries that carry state.

The torch planner writes the scatter sinks at the end of ``hot``, ``owner``
and ``stamp`` on every step and the fused planner does not, so the sinks must
not count: otherwise every step differs and a racy planner (stamps one clock
step ahead) reads the same as a correct one.
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import numpy as np

from tests.conftest import load_script


def _script() -> ModuleType:
    return load_script("planner_race_check")


def _tables(layers: int = 2, experts: int = 4, pool: int = 3, staging: int = 2) -> SimpleNamespace:
    keys, rows = layers * experts, pool + staging
    hot = np.full(keys + 1, -1, dtype=np.int32)
    hot[:pool] = np.arange(pool)
    owner = np.full(rows + 1, -1, dtype=np.int32)
    owner[:pool] = np.arange(pool)
    stamp = np.zeros(rows + 1, dtype=np.int64)
    stamp[pool:] = 2**62
    return SimpleNamespace(
        num_layers=layers, num_experts=experts, pool_rows=pool, staging_rows=staging,
        hot=hot, owner=owner, stamp=stamp, clock=np.array([7], dtype=np.int64),
    )  # fmt: skip


def test_identical_tables_with_different_sinks_do_not_differ() -> None:
    m = _script()
    fused, torch_planner = _tables(), _tables()
    torch_planner.hot[-1] = 5  # what the torch planner's masked scatters leave there
    torch_planner.owner[-1] = 3
    torch_planner.stamp[-1] = 7
    assert m.differing_entries(fused, torch_planner) == {
        "hot": 0, "owner": 0, "stamp": 0, "clock": 0,
    }  # fmt: skip


def test_stamps_one_step_ahead_differ() -> None:
    m = _script()
    fused, torch_planner = _tables(), _tables()
    for t in (fused, torch_planner):
        t.stamp[-1] = 7  # both sinks written alike: only the race remains
    fused.stamp[:2] = 8  # the race: hit rows stamped with the next clock value
    torch_planner.stamp[:2] = 7
    assert m.differing_entries(fused, torch_planner)["stamp"] == 2
