"""harness/bank_sim.py: the bank's step rules on hand-worked cases, the policies, the
synthetic trace generators, and the ``bank-sim`` command."""

from __future__ import annotations

import json
import random

import pytest

from harness import __main__ as cli
from harness import bank_sim, results
from harness.bank_sim import Bank, Frequency, Lfru, Policy, SecondMiss, Trace


def play(bank: Bank, policy: Policy, steps: list[list[list[list[int]]]]) -> list[tuple]:
    """Run hand-written ``steps[step][layer][token] = experts``; each layer step's
    (promoted, staged)."""
    policy.reset(bank)
    out = []
    for step, layers in enumerate(steps):
        for layer, tokens in enumerate(layers):
            lanes = bank_sim.lanes_per_expert(tokens)
            out.append(bank.layer_step(policy, layer, lanes, step))
    return out


def resident(bank: Bank, layer: int) -> set[int]:
    base = layer * bank.experts
    return {e for e in range(bank.experts) if bank.hot[base + e] >= 0}


# --- the bank's rules -----------------------------------------------------------------------------


def test_the_bank_starts_with_each_layers_first_experts() -> None:
    bank = Bank(layers=2, experts=4, rows=2, top_k=1)
    assert bank.owner == [0, 1, 4, 5] and resident(bank, 0) == {0, 1} == resident(bank, 1)


@pytest.mark.parametrize(
    ("policy", "popular_kept"), [(Policy(), False), (SecondMiss(window=100), True)]
)
def test_a_one_off_route_evicts_a_popular_row_only_under_promote_on_miss(policy, popular_kept):
    # Two layers of one row; both route their expert 0 at every step, but layer 0 routes
    # expert 5 once, at step 2. Its row is the least recently used one not used in that
    # layer step (layer 1's was used after it), so promote-on-miss evicts expert 0.
    bank = Bank(layers=2, experts=8, rows=1, top_k=1)
    steps = [[[[0]], [[0]]]] * 2 + [[[[5]], [[0]]]] + [[[[0]], [[0]]]] * 3
    plan = play(bank, policy, steps)
    assert plan[4] == (([], [5]) if popular_kept else ([5], []))
    # promote-on-miss: expert 0 misses once on its return, then stays; second-miss: never.
    assert bank.counters.misses == (1 if popular_kept else 2)
    assert resident(bank, 0) == {0} and resident(bank, 1) == {0}


def test_second_miss_promotes_an_expert_that_missed_within_the_window() -> None:
    bank = Bank(layers=1, experts=8, rows=2, top_k=1)
    steps = [[[[5]]], [[[0]]], [[[5]]], [[[0]]]]  # 5 misses at steps 0 and 2
    assert play(bank, SecondMiss(window=2), steps)[2] == ([5], [])
    bank = Bank(layers=1, experts=8, rows=2, top_k=1)
    assert play(bank, SecondMiss(window=1), steps)[2] == ([], [5])


def test_the_victim_is_the_least_recently_used_row_of_any_layer() -> None:
    # Rows 0, 1: layer 0's experts 0, 1; rows 2, 3: layer 1's experts 0, 1.
    bank = Bank(layers=2, experts=4, rows=2, top_k=1)
    steps = [
        [[[1]], [[1]]],  # clock 1: row 1; clock 2: row 3
        [[[0]], [[1]]],  # clock 3: row 0; clock 4: row 3
        [[[2]], [[1]]],  # clock 5: layer 0 misses expert 2
    ]
    play(bank, Policy(), steps)
    # Layer 1's expert 0 (row 2, never used) was the oldest row: layer 0 took it, not its own
    # row 1 (used at clock 1), as a per-layer LRU would.
    assert bank.owner == [0, 1, 2, 5]
    assert resident(bank, 0) == {0, 1, 2} and resident(bank, 1) == {1}


def test_equally_old_rows_go_in_row_order_and_rows_of_this_step_are_never_victims() -> None:
    bank = Bank(layers=1, experts=4, rows=2, top_k=2)
    # Expert 0 hits row 0; expert 3 may take only row 1; the bank then has no free row.
    assert play(bank, Policy(), [[[[0, 3]]]]) == [([3], [])]
    assert bank.owner == [0, 3]
    bank = Bank(layers=2, experts=4, rows=1, top_k=2)
    assert play(bank, Policy(), [[[[1]]]]) == [([1], [])] and bank.owner == [1, 4]
    # Layer 0 routes 1 (its row) and 2: the only other row is layer 1's.
    bank = Bank(layers=1, experts=4, rows=1, top_k=2)
    assert play(bank, Policy(), [[[[0, 2]]]]) == [([], [2])]


def test_at_most_top_k_misses_are_promoted_most_routed_first_the_rest_staged() -> None:
    bank = Bank(layers=1, experts=10, rows=6, top_k=2)
    # Three tokens: expert 7 thrice, 9 twice, 8 once, 6 once (6 < 8: first of the ties).
    tokens = [[7, 9], [7, 8], [7, 9, 6]]
    assert play(bank, Policy(), [[tokens]]) == [([7, 9], [6, 8])]
    c = bank.counters
    assert (c.routes, c.hits, c.misses, c.promotions) == (4, 0, 4, 2)
    assert bank.owner[:2] == [7, 9] and resident(bank, 0) == {2, 3, 4, 5, 7, 9}
    # Next step: staged experts were copied for their step only, so 8 misses again.
    play_more = bank.layer_step(Policy(), 0, {8: 1, 7: 1}, 1)
    assert play_more == ([8], []) and bank.counters.hits == 1


def test_frequency_admits_a_miss_only_once_its_count_exceeds_the_victims() -> None:
    bank = Bank(layers=1, experts=4, rows=1, top_k=1)
    steps = [[[[0]]]] * 5 + [[[[1]]]] * 5
    plan = play(bank, Frequency(half_life=1e9), steps)  # almost no decay
    # Expert 0 holds 5 routes; expert 1 is staged at 1..4 routes and promoted at its 5th
    # (as many routes, but newer ones weigh a hair more).
    assert [p for p, _ in plan[5:]] == [[]] * 4 + [[1]]
    assert bank.owner == [1]


def test_frequency_counts_decay() -> None:
    # Half-life 2 steps: at step 5, expert 0's five routes weigh 1.99 > 1, at step 6 1.41,
    # below expert 1's two routes (1.71).
    bank = Bank(layers=1, experts=4, rows=1, top_k=1)
    steps = [[[[0]]]] * 5 + [[[[1]]]] * 2
    plan = play(bank, Frequency(half_life=2.0), steps)
    assert [p for p, _ in plan[5:]] == [[], [1]]


def test_planner_frequency_is_the_planners_integer_rule() -> None:
    # The series' tables.py: FREQ_DECAY = round(2**16 * 2 ** (-1 / 25)) = 63744.
    assert bank_sim.PlannerFrequency().decay == 63744
    bank = Bank(layers=1, experts=4, rows=1, top_k=1)
    steps = [[[[0]]]] * 5 + [[[[1]]]] * 5
    policy = bank_sim.PlannerFrequency()
    plan = play(bank, policy, steps)
    # Five routes of expert 1 outweigh expert 0's five older ones, four do not.
    assert [p for p, _ in plan[5:]] == [[]] * 4 + [[1]]
    # Counts are fixed point: one route at the last step adds 256, older ones decay.
    assert policy.counts[1] > 4 * 256 and policy.counts[2] == 0
    assert policy.counts[0] < 5 * 256


@pytest.mark.parametrize(("candidates", "victim_expert"), [(1, 0), (3, 1)])
def test_lfru_evicts_the_least_frequent_of_the_oldest_rows(candidates, victim_expert) -> None:
    bank = Bank(layers=1, experts=6, rows=3, top_k=1)
    # Expert 0 routed thrice (oldest row), 1 and 2 once each (1 before 2).
    steps = [[[[0]]], [[[0]]], [[[0]]], [[[1]]], [[[2]]], [[[3]]]]
    plan = play(bank, Lfru(half_life=1e9, candidates=candidates), steps)
    assert plan[-1] == ([3], [])
    assert resident(bank, 0) == {0, 1, 2, 3} - {victim_expert}


def _reference_counters(layers, experts, rows, top_k, steps):
    """The planner's rules, written the slow way (sort every row by (stamp, row) per step)."""
    pool = layers * rows
    hot, owner, stamp, clock = [-1] * (layers * experts), [-1] * pool, [0] * pool, 0
    for layer in range(layers):
        for e in range(min(rows, experts - 1)):
            hot[layer * experts + e] = layer * rows + e
            owner[layer * rows + e] = layer * experts + e
    hits = misses = promoted = 0
    for layers_of_step in steps:
        for layer, tokens in enumerate(layers_of_step):
            lanes: dict[int, int] = {}
            for t in tokens:
                for e in t:
                    lanes[e] = lanes.get(e, 0) + 1
            base = layer * experts
            missed = [e for e in sorted(lanes) if hot[base + e] < 0]
            clock += 1
            for e in lanes:
                if hot[base + e] >= 0:
                    stamp[hot[base + e]] = clock
            free = sorted((stamp[r], r) for r in range(pool) if stamp[r] < clock)
            order = sorted(missed, key=lambda e: (-lanes[e], e))
            for e, (_, victim) in zip(order[:top_k], free, strict=False):
                if owner[victim] >= 0:
                    hot[owner[victim]] = -1
                hot[base + e], owner[victim], stamp[victim] = victim, base + e, clock
                promoted += 1
            hits += len(lanes) - len(missed)
            misses += len(missed)
    return (hits, misses, promoted), hot


def test_promote_on_miss_matches_the_planners_rules_on_random_traces() -> None:
    rng = random.Random(7)
    for _ in range(60):
        layers, experts = rng.randint(1, 4), rng.randint(3, 10)
        rows, top_k, tokens = rng.randint(1, experts), rng.randint(1, min(3, experts)), 3
        steps = [
            [[rng.sample(range(experts), top_k) for _ in range(rng.randint(1, tokens))]
             for _ in range(layers)]
            for _ in range(25)
        ]  # fmt: skip
        bank = Bank(layers, experts, rows, top_k)
        play(bank, Policy(), steps)
        c = bank.counters
        expected, hot = _reference_counters(layers, experts, rows, top_k, steps)
        assert (c.hits, c.misses, c.promotions) == expected and bank.hot == hot


def test_simulate_counts_only_after_the_warm_up() -> None:
    steps = [[[[0]]]] * 4 + [[[[1]]]] + [[[[2]]]] * 5  # 10 steps: the first 2 are warm-up
    trace = Trace("hand", steps, layers=1, experts=4, top_k=1, tokens=1, steps=10)
    c = bank_sim.simulate(trace, Policy(), rows=1)
    assert (c.routes, c.hits, c.misses) == (8, 6, 2)


def test_make_policy_reads_parameters_and_refuses_unknown_ones() -> None:
    policy = bank_sim.make_policy("lfru:candidates=8:half_life=50")
    assert isinstance(policy, Lfru) and policy.candidates == 8 and policy.half_life == 50
    assert policy.label == "lfru:candidates=8:half_life=50" and SecondMiss().label == "second-miss"
    for bad in ("lru", "second-miss:window", "second-miss:size=3", "frequency:half_life=x"):
        with pytest.raises(ValueError):
            bank_sim.make_policy(bad)


# --- traces ---------------------------------------------------------------------------------------

np = pytest.importorskip("numpy", reason="the trace generators need numpy")


@pytest.mark.parametrize("kind", bank_sim.TRACES)
def test_traces_have_their_shape_distinct_experts_and_repeat_with_the_seed(kind) -> None:
    args = {"layers": 3, "experts": 16, "top_k": 4, "tokens": 2, "steps": 50}
    trace = bank_sim.make_trace(kind, seed=1, **args)
    assert trace.routes.shape == (50, 3, 2, 4) and trace.kind == kind
    assert trace.routes.min() >= 0 and trace.routes.max() < 16
    assert all(len(set(tok)) == 4 for tok in trace.routes.reshape(-1, 4).tolist())
    assert np.array_equal(bank_sim.make_trace(kind, seed=1, **args).routes, trace.routes)
    assert not np.array_equal(bank_sim.make_trace(kind, seed=2, **args).routes, trace.routes)
    assert "not routes recorded from a served run" in trace.description


def test_the_skewed_trace_gives_the_issues_popularity_share() -> None:
    # The issue: the 22 / 32 most popular experts take 61.5% / 69.5% of the routes
    # (128 experts, top-8, Zipf s = 1); uniform routing gives them 22 / 128.
    skewed = bank_sim.make_trace("skewed", layers=6, steps=1500, seed=3)
    assert bank_sim.static_top_share(skewed, 22) == pytest.approx(0.615, abs=0.01)
    assert bank_sim.static_top_share(skewed, 32) == pytest.approx(0.695, abs=0.01)
    # Uniform: 22 / 128 = 17.2%, plus what picking the top 22 in hindsight adds.
    uniform = bank_sim.make_trace("uniform", layers=6, steps=1500, seed=3)
    assert 22 / 128 < bank_sim.static_top_share(uniform, 22) < 0.21


def test_the_drifting_trace_moves_its_hot_experts_every_period() -> None:
    args = {"layers": 4, "experts": 32, "top_k": 2, "steps": 600, "seed": 5}
    drifting = bank_sim.make_trace("drifting", drift_every=300, **args).routes
    skewed = bank_sim.make_trace("skewed", **args).routes

    def hottest(routes, start, stop):
        return [np.bincount(routes[start:stop, layer].ravel(), minlength=32).argmax()
                for layer in range(4)]  # fmt: skip

    assert hottest(skewed, 0, 300) == hottest(skewed, 300, 600)
    assert hottest(drifting, 0, 300) != hottest(drifting, 300, 600)
    assert hottest(drifting, 0, 150) == hottest(drifting, 150, 300)


def test_a_trace_refuses_impossible_parameters() -> None:
    with pytest.raises(ValueError, match="top_k"):
        bank_sim.make_trace("skewed", experts=4, top_k=5)
    with pytest.raises(ValueError, match="unknown trace"):
        bank_sim.make_trace("bursty")


# --- the command ----------------------------------------------------------------------------------


def test_verdict_names_where_a_policy_loses() -> None:
    cells = [
        {"trace": t, "tokens": 1, "rows": 2, "policy": p, "misses_vs_promote_on_miss": r}
        for t, p, r in [
            ("skewed", "promote-on-miss", 1.0), ("skewed", "x", 0.7),
            ("uniform", "promote-on-miss", 1.0), ("uniform", "x", 1.05),
            ("drifting", "promote-on-miss", 1.0), ("drifting", "x", 1.005),
        ]
    ]  # fmt: skip
    v = bank_sim.verdict(cells)["x"]
    assert v["loses_on"] == ["uniform (tokens 1, rows 2)"] and v["skewed_best"] == 0.7


def test_the_command_writes_its_result_with_provenance(tmp_path, capsys) -> None:
    argv = ["bank-sim", "--layers", "2", "--experts", "8", "--top-k", "2", "--steps", "30",
            "--rows", "2,3", "--tokens", "1", "--policy", "frequency",
            "--out", str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 0
    path = tmp_path / "bank-sim.json"
    assert results.validate(path) == []
    record = json.loads(path.read_text())
    assert record["kind"] == "bank-sim"
    prov = record["provenance"]
    assert "bank-sim" in prov["command"] and "--policy=frequency" in prov["command"]
    assert prov["cpu"] and prov["harness_commit"]
    data = record["data"]
    assert "not routes recorded" in data["synthetic"] and data["parameters"]["steps"] == 30
    # promote-on-miss runs as the reference: 3 traces x 2 row counts x 2 policies.
    assert len(data["cells"]) == 12 and {c["policy"] for c in data["cells"]} == {
        "promote-on-miss", "frequency"
    }  # fmt: skip
    base = [c for c in data["cells"] if c["policy"] == "promote-on-miss"]
    assert all(c["misses_vs_promote_on_miss"] == 1.0 for c in base)
    out = capsys.readouterr().out
    assert "| skewed | 1 | 2 |" in out and "synthetic" in out


def test_the_command_explains_itself_and_refuses_a_bad_policy(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bank-sim", "--help"])
    assert "SYNTHETIC" in capsys.readouterr().out
    assert cli.main(["bank-sim", "--policy", "lru", "--out", str(tmp_path)]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert not (tmp_path / "bank-sim.json").exists()
