"""scripts/staging_replay.py: the arithmetic (floor, TTFT, summary merge, goals, run-time
estimate) and, with a stand-in for torch, the order of hooks and syncs of its measurements."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import types
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "results" / "staging"


def _replay() -> ModuleType:
    return load_script("staging_replay")


def test_the_script_imports_without_torch_or_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes any import of the name fail.
    for name in ("torch", "vllm", "pool_decode_replay"):
        monkeypatch.setitem(sys.modules, name, None)
    m = _replay()
    assert m.floor_s(0.1, 0, 50.0) == pytest.approx(0.1)


# ---------------------------------------------------------------------------
# Floors, first and steady steps, TTFT


def test_floor_is_the_larger_of_compute_and_one_copy_of_the_set() -> None:
    m = _replay()
    # 11e9 bytes at 55 GB/s take 0.2 s.
    assert m.floor_s(0.150, 11e9, 55.0) == pytest.approx(0.200)
    assert m.floor_s(0.290, 11e9, 55.0) == pytest.approx(0.290)


def test_first_step_and_the_mean_of_the_later_ones() -> None:
    m = _replay()
    first, steady = m.first_and_steady([0.30, 0.20, 0.22, 0.24])
    assert first == pytest.approx(0.30)
    assert steady == pytest.approx(0.22)
    assert m.first_and_steady([0.5]) == (0.5, None)
    with pytest.raises(ValueError):
        m.first_and_steady([])


def test_repetitions_take_the_median_of_firsts_and_of_steady_means() -> None:
    m = _replay()
    agg = m.aggregate_runs([[0.30, 0.20, 0.22, 0.24], [0.34, 0.21, 0.21, 0.21]])
    assert agg["first_s"] == pytest.approx(0.32)
    assert agg["steady_s"] == pytest.approx(0.215)
    assert agg["median_s"] == pytest.approx(0.215)
    single = m.aggregate_runs([[0.4], [0.6], [0.5]])
    assert single == {"first_s": 0.5, "steady_s": None, "median_s": 0.5}


def test_ttft_takes_the_first_step_once_then_steady_steps_and_the_remainder() -> None:
    m = _replay()
    # 81,600 tokens = 9 x 8192 + 7872.
    assert m.chunks(81_600, 8192) == [8192] * 9 + [7872]
    t = m.ttft_s(81_600, 8192, {8192: 0.40}, {8192: 0.30, 7872: 0.29})
    assert t["seconds"] == pytest.approx(0.40 + 8 * 0.30 + 0.29)
    assert t["steps"] == 10
    assert t["estimated"] is False


def test_ttft_scales_an_unmeasured_remainder_and_says_so() -> None:
    m = _replay()
    t = m.ttft_s(81_600, 8192, {8192: 0.40}, {8192: 0.30})
    assert t["seconds"] == pytest.approx(0.40 + 8 * 0.30 + 0.30 * 7872 / 8192)
    assert t["estimated"] is True
    # A prompt shorter than the step is one first step of its own size.
    assert m.ttft_s(4000, 8192, {4000: 0.1}, {})["seconds"] == pytest.approx(0.1)
    with pytest.raises(KeyError):
        m.ttft_s(81_600, 8192, {4096: 0.4}, {4096: 0.3})


def test_ttft_of_the_floors_is_the_sum_of_the_steps_floors() -> None:
    m = _replay()
    floors = {8192: 0.29, 7872: 0.28}
    assert m.ttft_s(81_600, 8192, floors, floors)["seconds"] == pytest.approx(9 * 0.29 + 0.28)


# ---------------------------------------------------------------------------
# summary.json


def _per_size() -> dict[int, dict[str, Any]]:
    return {
        4096: {
            "resident_s": 0.150,
            "nonresident_bytes": 11e9,
            "staged": {"first_s": 0.25, "steady_s": 0.21},
            "host_view": {"first_s": 0.95, "steady_s": 0.96},
        },
        8192: {
            "resident_s": 0.290,
            "nonresident_bytes": 11e9,
            "staged": {"first_s": 0.33, "steady_s": None},
            "host_view": {"first_s": 1.80, "steady_s": 1.81},
        },
    }


def test_summary_rows_per_size_first_and_steady_with_the_floor() -> None:
    m = _replay()
    rows = m.summary_rows(128, _per_size(), 55.0)
    assert [(r["tokens"], r["steady_state"]) for r in rows] == [
        (4096, False),
        (4096, True),
        (8192, False),  # no steady-state staged time: no row
    ]
    assert all(set(r) == set(m.SUMMARY_ROW_KEYS) for r in rows)
    first, steady, wide = rows
    assert first["experts"] == 128
    assert first["staged_ms"] == pytest.approx(250.0)
    assert first["host_view_ms"] == pytest.approx(950.0)
    assert first["floor_ms"] == pytest.approx(200.0)  # copy-bound: 11e9 B at 55 GB/s
    assert first["ratio_to_floor"] == pytest.approx(1.25)
    assert steady["staged_ms"] == pytest.approx(210.0)
    assert steady["host_view_ms"] == pytest.approx(960.0)
    assert steady["ratio_to_floor"] == pytest.approx(1.05)
    assert wide["floor_ms"] == pytest.approx(290.0)  # compute-bound
    assert wide["ratio_to_floor"] == pytest.approx(0.33 / 0.29)


def _row(experts: int, tokens: int, steady: bool, staged: float, tag: str = "") -> dict[str, Any]:
    return {
        "experts": experts,
        "tokens": tokens,
        "staged_ms": staged,
        "host_view_ms": 5 * staged,
        "floor_ms": 100.0,
        "ratio_to_floor": staged / 100.0,
        "steady_state": steady,
        **({"tag": tag} if tag else {}),
    }


def _prov(date: str) -> dict[str, Any]:
    return {"command": "staging_replay.py", "date": date, "series_hash": date[-4:]}


def test_merge_replaces_rows_of_the_same_key_and_keeps_the_others() -> None:
    m = _replay()
    p256, p128_old, p128_new = _prov("day-0256"), _prov("day-0128"), _prov("day-new1")
    old = {
        "rows": [
            _row(256, 4096, False, 380.0),
            _row(256, 4096, True, 377.0),
            _row(128, 4096, True, 191.0, "old"),
            _row(128, 8192, True, 305.0, "old"),
        ],
        "provenance": {**p256, "shapes": {"256": p256, "128": p128_old}},
    }
    new = [_row(128, 4096, True, 185.0, "new"), _row(128, 4096, False, 200.0, "new")]
    merged = m.merge_summary(old, new, p128_new)
    assert set(merged) == {"schema", "kind", "rows", "provenance"}
    assert merged["kind"] == "staging-summary"
    keys = [(r["experts"], r["tokens"], r["steady_state"]) for r in merged["rows"]]
    assert keys == [
        (128, 4096, False),
        (128, 4096, True),
        (128, 8192, True),
        (256, 4096, False),
        (256, 4096, True),
    ]
    by_key = {k: r for k, r in zip(keys, merged["rows"], strict=True)}
    assert by_key[(128, 4096, True)]["staged_ms"] == 185.0  # replaced
    assert by_key[(128, 4096, True)]["tag"] == "new"
    assert by_key[(128, 8192, True)]["tag"] == "old"  # kept
    assert by_key[(256, 4096, True)]["staged_ms"] == 377.0  # the other shape untouched
    prov = merged["provenance"]
    assert prov["date"] == "day-new1"
    assert prov["shapes"] == {"128": p128_new, "256": p256}


def test_merge_over_nothing_is_this_runs_rows() -> None:
    m = _replay()
    p = _prov("day-0001")
    merged = m.merge_summary(None, [_row(128, 8192, True, 1.0), _row(128, 64, False, 2.0)], p)
    assert [r["tokens"] for r in merged["rows"]] == [64, 8192]
    assert merged["provenance"] == {**p, "shapes": {"128": p}}


def test_summary_of_an_earlier_summary_without_shapes_credits_its_own_run() -> None:
    m = _replay()
    p_old, p_new = _prov("day-0old"), _prov("day-0new")
    old = {"rows": [_row(256, 64, True, 9.0)], "provenance": p_old}
    merged = m.merge_summary(old, [_row(128, 64, True, 8.0)], p_new)
    assert merged["provenance"]["shapes"] == {"128": p_new, "256": p_old}


def test_write_summary_merges_the_file_given_and_leaves_it_alone(tmp_path: Path) -> None:
    m = _replay()
    first = tmp_path / "e128" / "summary.json"
    m.write_summary(first, [_row(128, 4096, True, 191.0)], _prov("day-0128"))
    before = first.read_text()
    second = tmp_path / "e256" / "summary.json"
    path, notes = m.write_summary(
        second, [_row(256, 4096, True, 377.0)], _prov("day-0256"), merge_from=first
    )
    assert path == second
    assert notes and "merged" in notes[0]
    rows = json.loads(second.read_text())["rows"]
    assert [(r["experts"], r["staged_ms"]) for r in rows] == [(128, 191.0), (256, 377.0)]
    assert first.read_text() == before
    # Without --summary the summary already in --out is the one merged.
    m.write_summary(second, [_row(256, 4096, True, 370.0)], _prov("day-0257"))
    rows = json.loads(second.read_text())["rows"]
    assert [(r["experts"], r["staged_ms"]) for r in rows] == [(128, 191.0), (256, 370.0)]


def test_write_summary_over_an_unreadable_file_writes_this_runs_rows(tmp_path: Path) -> None:
    m = _replay()
    out = tmp_path / "summary.json"
    out.write_text("{not json")
    _, notes = m.write_summary(out, [_row(128, 64, True, 1.0)], _prov("day-0001"))
    assert "not merged" in notes[0]
    assert len(json.loads(out.read_text())["rows"]) == 1


# ---------------------------------------------------------------------------
# Goals


def test_all_pass_is_three_valued() -> None:
    m = _replay()
    assert m.all_pass([]) is None
    assert m.all_pass([True, None]) is None
    assert m.all_pass([True, False, None]) is False
    assert m.all_pass([True, True]) is True


def _goal_rows(experts: int = 128) -> list[dict[str, Any]]:
    def row(tokens: int, steady: bool, staged: float, host: float, floor: float) -> dict[str, Any]:
        return {
            "experts": experts,
            "tokens": tokens,
            "staged_ms": staged,
            "host_view_ms": host,
            "floor_ms": floor,
            "ratio_to_floor": staged / floor,
            "steady_state": steady,
        }

    return [
        row(64, False, 240.0, 240.0, 171.7),
        row(64, True, 240.0, 239.0, 171.7),
        row(4096, False, 210.0, 950.0, 171.7),
        row(4096, True, 180.0, 956.0, 171.7),
        row(4608, True, 185.0, 1065.0, 171.7),
        row(8192, True, 300.0, 1800.0, 289.7),
    ]


def _goals(rows: list[dict[str, Any]], **kw: Any) -> dict[int, dict[str, Any]]:
    m = _replay()
    args: dict[str, Any] = {
        "experts": 128,
        "sweep_sizes": [64, 4096, 4608, 8192],
        "ttft": {"staged_s": 3.09, "host_view_s": 18.0, "floor_s": 2.90},
        "decode_on_over_off": 1.009,
    }
    args.update(kw)
    goals = m.goal_checks(rows, **args)
    assert len(goals) == 5
    return dict(enumerate(goals, start=1))


def test_goals_pass_on_numbers_that_meet_them() -> None:
    goals = _goals(_goal_rows())
    assert [g["pass"] for g in goals.values()] == [True, True, True, True, True]
    assert goals[1]["value"] == pytest.approx(185.0 / 171.7)  # 4608 is the worst
    assert goals[2]["value"] == pytest.approx(239.0 / 240.0)
    assert goals[3]["value"] == pytest.approx(3.09 / 2.90)
    assert goals[4]["value"] == pytest.approx(18.0 / 3.09)


def test_steady_state_step_over_110_percent_of_the_floor_fails() -> None:
    rows = _goal_rows()
    rows[4]["staged_ms"] = 1.11 * 171.7  # 4608, steady state
    goals = _goals(rows)
    assert goals[1]["pass"] is False
    assert [d["pass"] for d in goals[1]["detail"]] == [True, False, True]
    # Exactly 1.10 passes; a first step over it does not count.
    rows[4]["staged_ms"] = 1.10 * 171.7
    rows[2]["staged_ms"] = 2 * 171.7
    assert _goals(rows)[1]["pass"] is True


def test_a_goal_size_not_measured_leaves_the_floor_goal_open() -> None:
    goals = _goals([r for r in _goal_rows() if r["tokens"] != 8192])
    assert goals[1]["pass"] is None
    assert goals[1]["detail"][2] == {"tokens": 8192, "ratio_to_floor": None, "pass": None}


def test_staged_slower_than_the_host_view_at_any_sweep_size_fails() -> None:
    rows = _goal_rows()
    rows[0]["host_view_ms"] = 0.979 * rows[0]["staged_ms"]  # 64 tokens, first step
    goals = _goals(rows)
    assert goals[2]["pass"] is False
    failed = [(d["tokens"], d["steady_state"]) for d in goals[2]["detail"] if not d["pass"]]
    assert failed == [(64, False)]
    rows[0]["host_view_ms"] = 0.98 * rows[0]["staged_ms"]
    assert _goals(rows)[2]["pass"] is True
    # Sizes outside the sweep are not held to it; without a sweep the goal is open.
    assert _goals(rows, sweep_sizes=[4096])[2]["value"] == pytest.approx(950.0 / 210.0)
    assert _goals(rows, sweep_sizes=[])[2]["pass"] is None


def test_other_shapes_rows_do_not_count() -> None:
    rows = _goal_rows() + [
        {**r, "experts": 256, "staged_ms": 10 * r["staged_ms"]} for r in _goal_rows()
    ]
    assert [g["pass"] for g in _goals(rows).values()] == [True] * 5


def test_ttft_goals() -> None:
    rows = _goal_rows()
    over = _goals(rows, ttft={"staged_s": 3.20, "host_view_s": 18.0, "floor_s": 2.90})
    assert over[3]["pass"] is False  # 1.103 x the floors
    slow = _goals(rows, ttft={"staged_s": 3.09, "host_view_s": 15.0, "floor_s": 2.90})
    assert slow[4]["pass"] is False  # 4.85x
    # The 5x goal is set at 128 experts: at 256 the ratio is recorded, not judged.
    at256 = _goals(
        _goal_rows(256),
        experts=256,
        ttft={"staged_s": 3.09, "host_view_s": 9.0, "floor_s": 2.90},
    )
    assert at256[4]["pass"] is None
    assert at256[4]["value"] == pytest.approx(9.0 / 3.09)
    assert at256[3]["pass"] is True
    assert _goals(rows, ttft=None)[3]["pass"] is None


def test_decode_goal_is_one_percent_either_way() -> None:
    rows = _goal_rows()
    assert _goals(rows, decode_on_over_off=0.991)[5]["pass"] is True
    assert _goals(rows, decode_on_over_off=1.011)[5]["pass"] is False
    assert _goals(rows, decode_on_over_off=0.989)[5]["pass"] is False
    assert _goals(rows, decode_on_over_off=None)[5]["pass"] is None


# ---------------------------------------------------------------------------
# Plan, options, run-time estimate


def test_plan_sizes_and_modes() -> None:
    m = _replay()
    plan = m.measurement_plan([4096, 4608, 8192], sweep=True, remainders=True)
    # 12,500 and 81,600 modulo each step size.
    assert plan["remainders"] == [212, 3264, 3284, 3776, 4308, 7872]
    assert plan["summary"] == [64, 128, 256, 512, 1024, 2048, 4096, 4608, 8192]
    assert len(plan["sizes"]) == 15
    assert plan["modes"][7872] == ["resident", "host_view", "staged", "staged_sync"]
    assert plan["modes"][64] == ["resident", "host_view", "staged"]
    bare = m.measurement_plan([4608], sweep=False, remainders=False)
    assert bare["sizes"] == bare["summary"] == [4608]


def test_options() -> None:
    m = _replay()
    args = m.parse_args(["--out", "x"])
    assert (args.chunks, args.sweep, args.min_tokens) == (4, True, None)
    assert args.steps == [4096, 4608, 8192]
    assert m.parse_args(["--out", "x", "--no-sweep", "--chunks", "6"]).sweep is False
    assert m.parse_args(["--out", "x", "--quick"]).sweep is False
    assert m.parse_args(["--dry-run"]).out is None
    with pytest.raises(SystemExit):
        m.parse_args([])
    with pytest.raises(SystemExit):
        m.parse_args(["--out", "x", "--chunks", "0"])


def test_interpolation() -> None:
    m = _replay()
    points = {212: 0.2375, 4096: 0.9566}
    assert m.interpolate(points, 2154, False) == pytest.approx(0.2375 + 0.7191 * 1942 / 3884)
    assert m.interpolate(points, 64, False) == pytest.approx(0.2375)
    assert m.interpolate(points, 64, True) == pytest.approx(0.2375 * 64 / 212)
    assert m.interpolate(points, 8192, False) == pytest.approx(2 * 0.9566)


def test_estimate_by_hand() -> None:
    m = _replay()
    ms100 = {"on_median_ms": 100.0, "off_median_ms": 100.0}
    prior = {
        "seconds": 100.0,
        "copy_bound_s": 0.2,
        "steps": {
            "4096": {
                "host_view": {"median_s": 1.0, "reps": 3},
                "staged_sync": {"median_s": 0.5},
                "staged": {"median_s": 0.25},
                "resident": {"median_s": 0.2},
            }
        },
        "decode": {
            "samples": 10,
            "replays_per_sample": 5,
            "uniform": {"eager": ms100, "graphs": ms100},
        },
    }
    plan = m.measurement_plan([4096], sweep=False, remainders=False)
    est = m.estimate_seconds(
        prior, plan, chunks_per_run=4, reps=2, decode_iters=10, decode_replays=5
    )
    # Earlier run: 4 calls x (1 + 0.5 + 0.25 + 0.2) s of steps, 10 x (0.2 + 5 x 0.2) s decode.
    assert est["fixed_s"] == pytest.approx(100 - 7.8 - 12.0)
    # resident 9 x 0.2; host view 9 x 1.0 + 2 decode steps; staged 8 x 0.25 and
    # staged sync 8 x 0.5, each + 2 decode steps + 2 copies of the set (0.2 s).
    assert est["steps_s"] == pytest.approx(1.8 + 9.2 + 2.6 + 4.6)
    # Uniform and all-hit routes (not in the earlier run: counted as uniform).
    assert est["decode_s"] == pytest.approx(24.0)
    assert est["total_s"] == pytest.approx(m.PROCESS_START_S + 80.2 + 18.2 + 24.0)


@pytest.mark.parametrize(
    ("run", "shape"),
    [
        ("run3", ["--experts", "128", "--rows", "96"]),
        ("run2", ["--experts", "256", "--rows", "192"]),
    ],
)
def test_default_run_fits_in_eight_minutes(
    run: str, shape: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    m = _replay()
    source = RUNS / f"staging_replay_{run}.json"
    assert m.main(["--dry-run", "--estimate-from", str(source), *shape]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "warning" not in out
    assert out["estimate"]["total_s"] < 8 * 60


def test_count_runs_and_stats_delta() -> None:
    m = _replay()
    assert m.count_runs([True, True, False, True, False, False, True]) == 3
    assert m.count_runs([]) == 0
    assert m.count_runs([False, False]) == 0
    assert m.stats_delta({"a": 5, "b": 2}, {"a": 3}) == {"a": 2, "b": 2}


# ---------------------------------------------------------------------------
# The measurements' order of hooks and syncs, with a stand-in for torch


@dataclasses.dataclass
class _Stats:
    steps: int = 0
    layers_staged: int = 0
    bytes_copied: int = 0
    copies: int = 0
    carried: int = 0
    unplanned_layers: int = 0


class _World:
    """A log of what the replay asked for, and a clock (ms) the fake GPU work advances."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.now = 0.0


class _Tensor:
    def __init__(self, rows: int = 1, cost_ms: float = 0.0) -> None:
        self.shape = (rows, 4096)
        self.cost_ms = cost_ms

    def __truediv__(self, other: object) -> _Tensor:
        return self

    def bfloat16(self) -> _Tensor:
        return self

    def clone(self) -> _Tensor:
        return _Tensor(self.shape[0], self.cost_ms)

    def copy_(self, other: object) -> None:
        pass


def _fake_torch(world: _World) -> ModuleType:
    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self, stream: object = None) -> None:
            world.log.append("event")
            self.t = world.now

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other: Event) -> float:
            return other.t - self.t

    torch = types.ModuleType("torch")
    torch.cuda = SimpleNamespace(  # type: ignore[attr-defined]
        synchronize=lambda: world.log.append("sync"), Event=Event
    )
    torch.randn = lambda *a, **k: _Tensor(a[0], 1.0)  # type: ignore[attr-defined]
    return torch


def test_event_times_are_each_calls_own(monkeypatch: pytest.MonkeyPatch) -> None:
    world = _World()
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(world))
    costs = iter([3.0, 5.0])

    def work() -> None:
        world.log.append("work")
        world.now += next(costs)

    assert _replay().event_times_ms(work, 2) == [3.0, 5.0]
    assert world.log == ["event", "work", "event"] * 2


class _Stager:
    def __init__(self, world: _World) -> None:
        self.world = world
        self.prefetch = True
        self.cross_step = True
        self.min_tokens: int | None = None
        self.stats = _Stats()
        self.plan = SimpleNamespace(holdings=[None, None])
        self.buffer_bytes = 0

    def note_step(self) -> None:
        self.world.log.append("note")
        self.stats.steps += 1


class _Counts:
    """Stands in for a tensor of per-layer counters: ``(a > b).all()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __gt__(self, other: _Counts) -> Any:
        return SimpleNamespace(all=lambda: self.n > other.n)


class _Layer:
    def __init__(self, world: _World, index: int, count: int) -> None:
        self.world, self.index, self.count = world, index, count
        self.stager: _Stager | None = None

    def apply(self, x: _Tensor, w: object, ids: object) -> None:
        self.world.log.append("layer")
        self.world.now += x.cost_ms / self.count


def _fake_replay(
    monkeypatch: pytest.MonkeyPatch, layers: int = 3
) -> tuple[ModuleType, Any, _World]:
    m = _replay()
    world = _World()
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(world))
    rp = m.Replay.__new__(m.Replay)
    rp.args = argparse.Namespace(min_tokens=None, decode_tokens=8)
    rp.E = 128
    rp.gen = None
    rp.stager = _Stager(world)
    rp.pool = SimpleNamespace(
        layers=[_Layer(world, i, layers) for i in range(layers)],
        max_lanes=64,
        tables=SimpleNamespace(set_gate=lambda open_: world.log.append(f"gate {open_}")),
    )
    # The pool's open-gate decode counters: one more at every read.
    reads = iter(range(1 << 20))
    rp.decode_counts = lambda: _Counts(next(reads))
    routes = [(_Tensor(), _Tensor()) for _ in range(layers)]
    rp.decode_input = lambda: (_Tensor(8, 1.0), routes)
    rp.narrow_input = lambda: (_Tensor(16, 1.0), routes)
    return m, rp, world


def _inputs(tokens: int, costs: list[float], layers: int = 3) -> list[tuple[_Tensor, Any]]:
    return [(_Tensor(tokens, c), [(_Tensor(), _Tensor())] * layers) for c in costs]


def test_set_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    _, rp, _ = _fake_replay(monkeypatch)
    rp.set_mode("staged")
    st = rp.stager
    assert (st.prefetch, st.cross_step, st.min_tokens) == (True, True, None)
    assert all(layer.stager is st for layer in rp.pool.layers)
    rp.set_mode("staged_sync", min_tokens=512)
    assert (st.prefetch, st.cross_step, st.min_tokens) == (False, False, 512)
    rp.set_mode("host_view")
    assert all(layer.stager is None for layer in rp.pool.layers)
    with pytest.raises(ValueError):
        rp.set_mode("resident")


def test_a_staged_chunk_run_notes_every_step_and_syncs_only_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, rp, world = _fake_replay(monkeypatch)
    out = rp.chunk_run("staged", _inputs(4096, [30.0, 20.0, 22.0, 24.0]))
    log = world.log
    # Before the run: a narrow staged step without the cross-step copy, then a
    # decode step, then a sync.
    start = log.index("event")
    before, during = log[:start], log[start:]
    assert before == ["note", *["layer"] * 3, "note", *["layer"] * 3, "sync"]
    step = ["note", *["layer"] * 3, "event"]
    assert during == ["event", *step * 4, "sync"]
    assert out["step_s"] == pytest.approx([0.030, 0.020, 0.022, 0.024])
    assert out["stats"]["steps"] == 4
    assert out["first_step_stats"]["steps"] == 1
    # The run itself ran with prefetch, the cross-step copy and the cost model.
    st = rp.stager
    assert (st.prefetch, st.cross_step, st.min_tokens) == (True, True, None)


def test_host_view_and_resident_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    _, rp, world = _fake_replay(monkeypatch)
    rp.chunk_run("host_view", _inputs(512, [5.0, 5.0]))
    # No staged step to clear the buffers; the hook is still called (it keeps
    # the stager's residency copy current).
    # One decode step first (no narrow staged step), then the two chunks.
    assert world.log[0] == "note"
    assert world.log.count("note") == 3
    assert all(layer.stager is None for layer in rp.pool.layers)

    world.log.clear()

    def resident(x: _Tensor, routes: object, resident: object) -> None:
        world.log.append("resident")
        world.now += x.cost_ms

    rp.resident_step = resident
    out = rp.chunk_run("resident", _inputs(512, [7.0, 6.0, 6.0]), resident=[])
    assert world.log == ["sync", "event", *["resident", "event"] * 3, "sync"]
    assert out["step_s"] == pytest.approx([0.007, 0.006, 0.006])
    assert "stats" not in out


def test_decode_notes_before_every_on_step_and_never_before_an_off_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m, rp, world = _fake_replay(monkeypatch)
    monkeypatch.setattr(m, "time", SimpleNamespace(perf_counter=lambda: world.now / 1e3))
    monkeypatch.setattr(m, "uniform_routes", lambda *a: (_Tensor(), _Tensor()))
    rp.resident_routes = lambda tokens: [(_Tensor(), _Tensor())] * 3

    class Graph:
        def __init__(self, on: bool) -> None:
            self.on = on

        def replay(self) -> None:
            world.log.append("replay on" if self.on else "replay off")
            world.now += 5.0

    def capture_graph(fn: Any) -> Graph:
        return Graph(rp.pool.layers[0].stager is not None)

    monkeypatch.setattr(m, "_decode_replay", lambda: SimpleNamespace(capture_graph=capture_graph))
    out = rp.decode(iters=4, replays=2)
    log = world.log
    replays = [i for i, e in enumerate(log) if e.startswith("replay")]
    assert len(replays) == 2 * 4 * 2 * 2  # kinds x samples x modes x replays
    for i in replays:
        noted = log[i - 1] == "note"
        assert noted == (log[i] == "replay on"), (i, log[i - 1], log[i])
    # Eager steps: "note" precedes the layers of an on step only.
    eager = [i for i, e in enumerate(log) if e == "layer" and log[i - 1] in ("sync", "note")]
    assert len(eager) == 2 * 4 * 2
    assert sum(log[i - 1] == "note" for i in eager) == 2 * 4
    assert out["on_over_off"] == pytest.approx(1.0)
    assert out["decode_path_checked"] is True
    assert world.log[0] == "gate True"
    assert all(layer.stager is rp.stager for layer in rp.pool.layers)


def test_a_whole_run_on_stand_ins_writes_the_result_and_the_summary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's plumbing end to end (main, run, measure_size, TTFT, summary,
    goals, table) over stand-ins for torch, vLLM and the GPU work."""
    m, rp, world = _fake_replay(monkeypatch)
    fake_torch = sys.modules["torch"]
    fake_torch.randn = lambda *a, **k: _Tensor(a[0], a[0] / 100)  # type: ignore[attr-defined]
    fake_torch.cuda.empty_cache = lambda: None  # type: ignore[attr-defined]
    nonresident = 1344 * 7_077_896
    rp.row_bytes = {"w13_weight": 7_077_896}
    rp.pinned_gib, rp.host_sets, rp.build_s = 6.75, [{}] * 8, 1.0
    rp.pool.geometry = SimpleNamespace(total_bytes=27 << 30)
    rp.stager.buffer_bytes = 900 << 20
    rp.shuffle_residency = lambda rounds: {"nonresident_bytes_per_step": nonresident}
    rp.residency = lambda: {"nonresident_bytes_per_step": nonresident}
    rp.copy_bandwidth = lambda reps: {"gbps_median": 51.7}

    def uva_copy(reps: int) -> dict[str, Any]:
        raise RuntimeError("no GPU")

    rp.uva_copy_bandwidth = uva_copy
    rp.correctness = lambda tokens: {
        "finite": True,
        "layers_staged": 3,
        "bitwise_equal": True,
        "reference_repeatable": True,
        "max_abs_diff": 0.0,
    }
    rp.resident_sets = lambda: []
    rp.resident_step = lambda x, routes, resident: setattr(world, "now", world.now + x.cost_ms)
    rp.hostview_bytes_model = lambda routes, tokens: 4 * nonresident
    rp.resident_routes = lambda tokens: [(_Tensor(), _Tensor())] * 3
    monkeypatch.setattr(m, "Replay", lambda args: rp)
    monkeypatch.setattr(m, "uniform_routes", lambda *a: (_Tensor(), _Tensor()))
    monkeypatch.setattr(m, "pinned_h2d_bandwidth", lambda *a: {"gbps_median": 55.4})

    class Sampler:
        available, error, bytes = False, "no NVML here", None

        def __enter__(self) -> Sampler:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(m, "PcieSampler", Sampler)

    def write_result(out: Path, kind: str, data: dict[str, Any]) -> Path:
        path = out / f"{kind}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"schema": 1, "kind": kind, "provenance": _prov("day-test"), "data": data}
        path.write_text(json.dumps(record))
        return path

    class Graph:
        def replay(self) -> None:
            world.now += 5.0

    monkeypatch.setattr(
        m,
        "_decode_replay",
        lambda: SimpleNamespace(capture_graph=lambda fn: Graph(), write_result=write_result),
    )
    monkeypatch.setattr(m, "_need_stage", lambda: None)
    monkeypatch.setattr(m, "replay_vllm_config", lambda widest: None)
    vllm = types.ModuleType("vllm")
    vllm_config = types.ModuleType("vllm.config")
    vllm_config.set_current_vllm_config = lambda config: contextlib.nullcontext()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.config", vllm_config)

    earlier = tmp_path / "earlier.json"
    earlier.write_text(
        json.dumps({"rows": [_row(256, 4096, True, 377.0)], "provenance": _prov("day-0256")})
    )
    out = tmp_path / "e128"
    argv = ["--out", str(out), "--experts", "128", "--rows", "96", "--layers", "3"]
    argv += ["--chunks", "3", "--decode-iters", "2", "--decode-replays", "1"]
    assert m.main([*argv, "--summary", str(earlier)]) == 0
    data = json.loads((out / "staging_replay.json").read_text())["data"]
    assert "failed" not in data, data.get("traceback")
    # A failing UVA-copy probe is recorded and does not end the run.
    assert data["errors"] == ["uva_copy: RuntimeError('no GPU')"] and "uva_copy" not in data
    assert len(data["steps"]) == 15
    assert set(data["steps"]["7872"]) >= {"resident", "host_view", "staged", "staged_sync"}
    assert data["steps"]["4608"]["staged"]["runs"][0]["step_s"][0] > 0
    assert len(data["goals"]) == 5
    assert data["stager_checks"] == {"unplanned_layers": 0, "ok": True}
    assert data["ttft_moe_only"]["staged_8192_81.6K"]["steps"] == 10
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"schema", "kind", "rows", "provenance"}
    keys = {(r["experts"], r["tokens"], r["steady_state"]) for r in summary["rows"]}
    assert len(keys) == len(summary["rows"]) == 9 * 2 + 1
    assert (256, 4096, True) in keys
    assert all(set(r) == set(m.SUMMARY_ROW_KEYS) for r in summary["rows"])
    assert set(summary["provenance"]["shapes"]) == {"128", "256"}
    printed = capsys.readouterr().out
    assert "[" in printed  # the goals' verdicts were printed
    assert "error: uva_copy: RuntimeError('no GPU')" in printed
