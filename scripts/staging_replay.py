"""Layer-level replay of expert-pool prefill staging (series commit 0004).

Builds a stack of ``--layers`` synthetic NVFP4 MoE layers of a GLM-like
per-rank shape (hidden 4096, intermediate 1024 per partition, ``--experts``
experts, top-8) in pinned host memory, installs the expert pool of series
commit 0001 with the prefill stager of 0004 over them (``--rows`` pool rows
per layer), shuffles residency with decode steps under the global LRU, and
then measures, with the real Marlin kernel:

* multi-chunk prompts: for each step size, ``--chunks`` consecutive steps of
  that size (distinct inputs and uniform routes per chunk), with no host sync
  between them - as vLLM runs a chunked prefill - timed per step with CUDA
  events on the compute stream, repeated ``--reps`` times. Each pool run is
  preceded by one synchronized decode step (a prompt arriving while other
  requests decode), and each staged run by a narrow staged step without the
  cross-step copy, so that its first step finds no copy of layer 0 left by an
  earlier run. Reported per size and mode: the first step
  (``first_s``, median over the repetitions) and the steady state
  (``steady_s``, median over the repetitions of the mean of steps 2..N).
  Modes: ``resident`` (every expert on the GPU, stock ``fused_marlin_moe``),
  ``host_view`` (the stager detached: the partition path reads non-resident
  experts through UVA), ``staged_sync`` (staging without next-layer prefetch
  and without the cross-step copy of layer 0: each layer's copy starts after
  the work queued before it) and ``staged`` (prefetch and cross-step copy on);
  ``--min-tokens`` unset leaves the stager's cost model to decide per step;
* step sizes: ``--steps`` (default 4096, 4608, 8192, the goal sizes), the
  remainders of 12.5K- and 81.6K-token prompts at those sizes, and, with
  ``--sweep`` (default), 64, 128, 256, 512, 1024, 2048, 4096, 4608 and 8192
  tokens; ``staged_sync`` only at ``--steps`` and their remainders;
* bytes over PCIe per step: staged bytes exactly (stager counters), host-view
  bytes from a model (one read of an expert per Marlin M-block) and, where
  NVML is available, integrated from NVML PCIe RX throughput samples
  (approximate: the counter is a KB/s rate over a ~20 ms window);
* the pinned host-to-device copy bandwidth of this machine in the same run,
  and the stager's copy rate (staged steps too narrow to compute much);
* the rate of the pool's copy kernel reading non-resident rows through the
  host view (``uva_copy``: how a routed-only copy would have to run without
  a host sync); a failure of this probe is recorded under ``errors``;
* MoE-only TTFT estimates for 12.5K and 81.6K-token prompts from the
  per-step times: the first chunk's first-step time, then steady-state times
  for the other full chunks and the remainder;
* decode step time (``--decode-tokens`` tokens) with staging on (stager
  attached, ``note_step`` before every step, as the vLLM worker calls it) and
  off (detached, no hook), interleaved: replayed from CUDA graphs (what the
  goal uses: the seed decoded under FULL_DECODE_ONLY) and, for reference,
  eager.

The replay calls ``stager.note_step()`` before every pool step it runs
(the worker's hook: it refreshes the stager's copy of the residency table),
except in the decode measurement's "off" steps, which stand for a server
without staging.

It checks issue #18's goals and records pass/fail for each (the floor of a
step is max(all-resident compute at that size, non-resident bytes / measured
pinned H2D bandwidth)):

1. steady-state staged step <= 1.10 x floor at 4096, 4608 and 8192 tokens;
2. at every sweep size, host view / staged >= 0.98 (staged no slower);
3. MoE-only TTFT at 81.6K tokens (8192-token chunks, first step, then steady
   state) <= 1.10 x the sum of those steps' floors, and host view / staged
   >= 5x there at 128 experts;
4. decode with staging on within 1% of off (CUDA graphs).

It writes ``summary.json`` next to the result: ``{"schema", "kind":
"staging-summary", "rows": [...], "provenance": {...}}``, one row per
(experts, tokens, steady_state) of the sweep and goal sizes with
``staged_ms``, ``host_view_ms``, ``floor_ms`` and ``ratio_to_floor``. Rows
of an earlier summary (``--summary``, default the one already in ``--out``:
another shape's run) are kept unless this run measured the same experts,
tokens and steady_state; ``provenance.shapes`` names the run behind each
experts value.

The seed's numbers are end-to-end TTFT of a whole model (GLM-5.3-Flash NVFP4,
TP=2, RTX PRO 6000, PCIe); ours cover only the routed experts of an
``--layers``-layer stack on one H200, so only ratios are compared.

Layers: 42 by default, the seed model's pooled MoE layers as inferred in
SERIES.md. The layers share ``--host-sets`` distinct pinned expert sets round
robin, which keeps host memory bounded; timing depends on the bytes moved and
computed, not on which bytes they are.

Memory (defaults: 42 layers x 256 experts, 6.75 MiB per expert, 8 host sets):
13.5 GiB of pinned host memory; on the GPU a 53 GiB bank (192 rows per layer),
3.4 GiB of staging buffers and 13.5 GiB for the all-resident baseline.

Run time at defaults for one shape, estimated with ``--dry-run
--estimate-from`` from the step and decode times of runs 3 and 2
(results/staging/): about 4.9 min at 128 experts (96 rows) and at most 6.9 min
at 256 (192 rows; run 2 timed no decode routes to resident experts, so the
estimate counts them at the uniform routes' 104 ms).

Needs torch and a vLLM import containing the expert pool and
``expert_pool/stage.py`` with the stager API of issue #18 (``pool.stager``,
``note_step``, ``cross_step``, ``min_tokens=None`` for the cost model), except
``--dry-run``, which needs neither. From the repository root::

    PYTHONPATH=.:<vllm tree> python scripts/staging_replay.py \\
        --out results/staging_replay [--quick]
    python3 scripts/staging_replay.py --dry-run \\
        --estimate-from results/staging/staging_replay_run3.json --experts 128 --rows 96

Writes ``staging_replay.json`` (harness result schema, kind
``staging_replay``) and ``summary.json`` to ``--out`` and prints a short table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HIDDEN, INTER, TOP_K = 4096, 1024, 8
GIB = 1 << 30
SEED_TTFT_S: dict[str, dict[str, float]] = {
    # Seed (vllm-project/vllm#56177 follow-up, 2x RTX PRO 6000, TP=2), end to end.
    "host_view_4096": {"12.5K": (9.5 + 9.8) / 2, "81.6K": 67.6},
    "staged_sync_4096": {"12.5K": 3.60, "81.6K": 18.9},
    "staged_sync_8192_eff_4608": {"12.5K": (2.39 + 2.47) / 2, "81.6K": 14.7},
    "staged_8192_eff_4608": {"12.5K": (1.81 + 1.83) / 2, "81.6K": 13.0},
}
SEED_NOTE = "8192 batched tokens ran 4608-token steps on the seed's hybrid model"
PROMPTS = {"12.5K": 12_500, "81.6K": 81_600}
FEED_ROUTES = 64  # route sets cycled through by the decode graph replays
POOL_MODES = ("host_view", "staged_sync", "staged")

# Issue #18's goals.
SWEEP_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 4608, 8192)
GOAL_SIZES = (4096, 4608, 8192)
FLOOR_LIMIT = 1.10  # steady-state staged step / floor, and TTFT / sum of floors
SPEED_RATIO_MIN = 0.98  # host view / staged at every sweep size
TTFT_PROMPT, TTFT_STEP = "81.6K", 8192
TTFT_HOST_RATIO_MIN, TTFT_HOST_RATIO_EXPERTS = 5.0, 128
DECODE_TOLERANCE = 0.01
SUMMARY_ROW_KEYS = (
    "experts",
    "tokens",
    "staged_ms",
    "host_view_ms",
    "floor_ms",
    "ratio_to_floor",
    "steady_state",
)
# Start-up outside the script's own clock (imports, CUDA context): device_run3
# timed the replay process at 238.0 s, the script's "seconds" were 219.5 s.
PROCESS_START_S = 20.0


# ---------------------------------------------------------------------------
# Arithmetic (no torch): floors, aggregation, TTFT, summary, goals, estimate


def chunks(prompt: int, step: int) -> list[int]:
    """Prefill chunk sizes of a prompt at a given step size."""
    out = [step] * (prompt // step)
    if prompt % step:
        out.append(prompt % step)
    return out


def floor_s(resident_s: float, nonresident_bytes: float, h2d_gbps: float) -> float:
    """The goals' floor of a step: max(compute with every expert resident,
    one copy of the non-resident set at pinned H2D bandwidth, GB/s = 1e9 B/s)."""
    return max(resident_s, nonresident_bytes / (h2d_gbps * 1e9))


def first_and_steady(step_s: Sequence[float]) -> tuple[float, float | None]:
    """A multi-chunk run's first step, and the mean of steps 2..N (None for N=1)."""
    if not step_s:
        raise ValueError("a run of no steps")
    steady = statistics.fmean(step_s[1:]) if len(step_s) > 1 else None
    return step_s[0], steady


def aggregate_runs(runs: Sequence[Sequence[float]]) -> dict[str, float | None]:
    """Repetitions of a multi-chunk run: median first step, median steady state.

    ``median_s`` is the steady state where there is one (the first step
    otherwise): the per-step time older readers of the result look up.
    """
    pairs = [first_and_steady(r) for r in runs]
    first = statistics.median(p[0] for p in pairs)
    steadies = [p[1] for p in pairs if p[1] is not None]
    steady = statistics.median(steadies) if steadies else None
    return {"first_s": first, "steady_s": steady, "median_s": first if steady is None else steady}


def ttft_s(
    prompt: int, step: int, first: Mapping[int, float], steady: Mapping[int, float]
) -> dict[str, Any]:
    """Prefill time of a prompt in chunks of ``step`` tokens from per-step times.

    The first chunk takes ``first[step]``; every later chunk, the remainder
    included, its size's steady-state time. A size missing from a table is
    scaled linearly from that table's ``step`` entry (``estimated``). For the
    sum of the steps' floors pass the floors as both tables.
    """
    parts = chunks(prompt, step)
    estimated = False

    def pick(table: Mapping[int, float], tokens: int) -> float:
        nonlocal estimated
        if tokens in table:
            return table[tokens]
        if step not in table:
            raise KeyError(f"no {step}-token step measured")
        estimated = True
        return table[step] * tokens / step

    seconds = pick(first, parts[0]) + sum(pick(steady, c) for c in parts[1:])
    return {"seconds": seconds, "steps": len(parts), "chunks": parts, "estimated": estimated}


def summary_rows(
    experts: int, per_size: Mapping[int, Mapping[str, Any]], h2d_gbps: float
) -> list[dict[str, Any]]:
    """``summary.json`` rows of one shape: per size, the first step and the steady state.

    ``per_size[tokens]`` holds ``resident_s`` (all-resident compute),
    ``nonresident_bytes`` and, for ``staged`` and ``host_view``, a mapping with
    ``first_s`` and ``steady_s`` (None when not measured: no row then).
    """
    rows = []
    for tokens in sorted(per_size):
        size = per_size[tokens]
        floor = floor_s(size["resident_s"], size["nonresident_bytes"], h2d_gbps)
        for steady_state, key in ((False, "first_s"), (True, "steady_s")):
            staged, host = size["staged"][key], size["host_view"][key]
            if staged is None or host is None:
                continue
            rows.append(
                {
                    "experts": experts,
                    "tokens": tokens,
                    "staged_ms": staged * 1e3,
                    "host_view_ms": host * 1e3,
                    "floor_ms": floor * 1e3,
                    "ratio_to_floor": staged / floor,
                    "steady_state": steady_state,
                }
            )
    return rows


def row_key(row: Mapping[str, Any]) -> tuple[int, int, bool]:
    """What a summary row is one of: (experts, tokens, steady_state)."""
    return int(row["experts"]), int(row["tokens"]), bool(row["steady_state"])


def merge_summary(
    old: Mapping[str, Any] | None, rows: Sequence[Mapping[str, Any]], provenance: Mapping[str, Any]
) -> dict[str, Any]:
    """This run's rows over an earlier summary's: same key replaced, the others kept.

    The provenance is this run's, with ``shapes``: per experts value (as a
    string), the provenance of the run whose rows it holds.
    """
    new_keys = {row_key(r) for r in rows}
    old_rows = list(old.get("rows", [])) if old else []
    kept: list[dict[str, Any]] = [dict(r) for r in old_rows if row_key(r) not in new_keys]
    merged = sorted([*kept, *(dict(r) for r in rows)], key=row_key)
    this = {k: v for k, v in provenance.items() if k != "shapes"}
    shapes: dict[str, Any] = {}
    if old:
        old_prov = dict(old.get("provenance") or {})
        shapes.update(old_prov.get("shapes") or {})
        own = {k: v for k, v in old_prov.items() if k != "shapes"}
        for r in kept:
            shapes.setdefault(str(row_key(r)[0]), own)
    for row in rows:
        shapes[str(row_key(row)[0])] = this
    present = {str(row_key(r)[0]) for r in merged}
    ordered = {k: shapes[k] for k in sorted(shapes, key=int) if k in present}
    from harness.results import SCHEMA

    return {
        "schema": SCHEMA,
        "kind": "staging-summary",
        "rows": merged,
        "provenance": {**this, "shapes": ordered},
    }


def write_summary(
    out: Path,
    rows: Sequence[Mapping[str, Any]],
    provenance: Mapping[str, Any],
    merge_from: Path | None = None,
) -> tuple[Path, list[str]]:
    """Write ``out`` (``summary.json``), merged over ``merge_from`` (default ``out``)
    where that file exists. Returns the path and notes (an unreadable earlier file
    is noted and not merged)."""
    source = out if merge_from is None else merge_from
    notes: list[str] = []
    old = None
    if source.exists():
        try:
            old = json.loads(source.read_text())
            if not isinstance(old, dict) or not isinstance(old.get("rows"), list):
                raise ValueError("not a summary (no rows)")
            notes.append(f"merged with {source} ({len(old['rows'])} rows)")
        except (OSError, ValueError) as exc:
            notes.append(f"not merged: {source}: {exc}")
            old = None
    summary = merge_summary(old, rows, provenance)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return out, notes


def all_pass(values: Iterable[bool | None]) -> bool | None:
    """False if any fails, True if all pass, else None (something not measured)."""
    vals = list(values)
    if any(v is False for v in vals):
        return False
    if vals and all(v is True for v in vals):
        return True
    return None


def goal_checks(
    rows: Sequence[Mapping[str, Any]],
    *,
    experts: int,
    sweep_sizes: Sequence[int],
    ttft: Mapping[str, float] | None,
    decode_on_over_off: float | None,
) -> list[dict[str, Any]]:
    """Issue #18's goals from this shape's summary rows, the 81.6K-token TTFT
    (``staged_s``, ``host_view_s``, ``floor_s``: sums over its steps) and the
    decode ratio (CUDA graphs); ``pass`` is None where a goal was not measured."""
    mine = [r for r in rows if int(r["experts"]) == experts]
    steady = {int(r["tokens"]): r for r in mine if r["steady_state"]}
    goals: list[dict[str, Any]] = []

    g1: list[dict[str, Any]] = []
    for tokens in GOAL_SIZES:
        r = steady.get(tokens)
        if r is None:
            g1.append({"tokens": tokens, "ratio_to_floor": None, "pass": None})
            continue
        ratio = r["staged_ms"] / r["floor_ms"]
        g1.append(
            {
                "tokens": tokens,
                "staged_ms": r["staged_ms"],
                "floor_ms": r["floor_ms"],
                "ratio_to_floor": ratio,
                "pass": ratio <= FLOOR_LIMIT,
            }
        )
    goals.append(
        {
            "goal": f"steady-state staged step <= {FLOOR_LIMIT:.2f} x floor at "
            + ", ".join(str(t) for t in GOAL_SIZES)
            + " tokens (floor: max(all-resident compute, non-resident bytes / pinned H2D))",
            "value": max(
                (g["ratio_to_floor"] for g in g1 if g["ratio_to_floor"] is not None), default=None
            ),
            "detail": g1,
            "pass": all_pass(g["pass"] for g in g1),
        }
    )

    g2: list[dict[str, Any]] = []
    for r in mine:
        if int(r["tokens"]) not in sweep_sizes:
            continue
        speed = r["host_view_ms"] / r["staged_ms"]
        g2.append(
            {
                "tokens": int(r["tokens"]),
                "steady_state": bool(r["steady_state"]),
                "host_view_over_staged": speed,
                "pass": speed >= SPEED_RATIO_MIN,
            }
        )
    goals.append(
        {
            "goal": f"host view / staged >= {SPEED_RATIO_MIN} at every sweep size "
            "(staged no slower than the host view), first and steady-state steps",
            "value": min((g["host_view_over_staged"] for g in g2), default=None),
            "detail": g2,
            "pass": all_pass(g["pass"] for g in g2) if g2 else None,
        }
    )

    what = f"MoE-only TTFT at {TTFT_PROMPT} tokens, {TTFT_STEP}-token chunks"
    if ttft is None:
        goals.append({"goal": f"{what} <= {FLOOR_LIMIT:.2f} x sum of floors", "pass": None})
        goals.append({"goal": f"{what}: host view / staged >= 5x", "pass": None})
    else:
        ratio = ttft["staged_s"] / ttft["floor_s"]
        goals.append(
            {
                "goal": f"{what} <= {FLOOR_LIMIT:.2f} x the sum of its steps' floors",
                "value": ratio,
                "staged_s": ttft["staged_s"],
                "floor_s": ttft["floor_s"],
                "pass": ratio <= FLOOR_LIMIT,
            }
        )
        speed = ttft["host_view_s"] / ttft["staged_s"]
        applies = experts == TTFT_HOST_RATIO_EXPERTS
        goal: dict[str, Any] = {
            "goal": f"{what}: host view / staged >= {TTFT_HOST_RATIO_MIN:g}x at "
            f"{TTFT_HOST_RATIO_EXPERTS} experts",
            "value": speed,
            "host_view_s": ttft["host_view_s"],
            "staged_s": ttft["staged_s"],
            "pass": speed >= TTFT_HOST_RATIO_MIN if applies else None,
        }
        if not applies:
            goal["note"] = (
                f"the goal is set at {TTFT_HOST_RATIO_EXPERTS} experts; this is {experts}"
            )
        goals.append(goal)

    goals.append(
        {
            "goal": f"decode with staging on within {DECODE_TOLERANCE:.0%} of off (CUDA graphs)",
            "value": decode_on_over_off,
            "pass": None
            if decode_on_over_off is None
            else abs(decode_on_over_off - 1) <= DECODE_TOLERANCE,
        }
    )
    return goals


def measurement_plan(steps: Sequence[int], sweep: bool, remainders: bool) -> dict[str, Any]:
    """Step sizes and the modes measured at each.

    ``main``: ``--steps``; ``remainders``: the last chunks of the prompts of
    :data:`PROMPTS` at those sizes; ``summary``: the sizes of ``summary.json``
    (``--steps`` and the sweep). ``staged_sync`` runs at main sizes and their
    remainders only.
    """
    main = sorted(set(steps))
    rem = sorted({p % s for s in main for p in PROMPTS.values() if p % s}) if remainders else []
    sweep_sizes = list(SWEEP_SIZES) if sweep else []
    sizes = sorted(set(main) | set(rem) | set(sweep_sizes))
    modes = {
        t: ["resident", "host_view", "staged"] + (["staged_sync"] if t in main or t in rem else [])
        for t in sizes
    }
    return {
        "sizes": sizes,
        "main": main,
        "remainders": rem,
        "sweep": sweep_sizes,
        "summary": sorted(set(main) | set(sweep_sizes)),
        "modes": modes,
    }


def interpolate(points: Mapping[int, float], tokens: int, proportional_below: bool) -> float:
    """A per-step time at ``tokens`` from measured sizes: linear between them,
    proportional above the largest, and below the smallest either flat (a
    host-view step reads about every non-resident expert once however narrow)
    or proportional (compute)."""
    if tokens in points:
        return points[tokens]
    xs = sorted(points)
    if tokens < xs[0]:
        return points[xs[0]] * (tokens / xs[0] if proportional_below else 1.0)
    if tokens > xs[-1]:
        return points[xs[-1]] * tokens / xs[-1]
    hi = next(x for x in xs if x > tokens)
    lo = max(x for x in xs if x < tokens)
    return points[lo] + (points[hi] - points[lo]) * (tokens - lo) / (hi - lo)


def _decode_kinds(decode: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """Route kinds of a result's decode entry (run 2 had uniform routes only, at the top)."""
    kinds = {k: decode[k] for k in ("uniform", "all_hits") if k in decode}
    return kinds or {"uniform": decode}


def _decode_seconds(kind: Mapping[str, Any], samples: int, replays: int, fair: bool) -> float:
    """Eager and graph samples of one route kind, both modes (``fair``: the larger
    eager time for both, where a run's eager timing was an artifact)."""
    eager, graphs = kind["eager"], kind["graphs"]
    eager_ms = (
        2 * max(eager["on_median_ms"], eager["off_median_ms"])
        if fair
        else eager["on_median_ms"] + eager["off_median_ms"]
    )
    graph_ms = graphs["on_median_ms"] + graphs["off_median_ms"]
    return float(samples * (eager_ms + replays * graph_ms) / 1e3)


def estimate_seconds(
    prior: Mapping[str, Any],
    plan: Mapping[str, Any],
    *,
    chunks_per_run: int,
    reps: int,
    decode_iters: int,
    decode_replays: int,
) -> dict[str, Any]:
    """Run time of a plan from an earlier run's ``data`` at the same shape.

    Per-step times are interpolated over the earlier run's sizes; each pool
    run adds a decode step, each staged run a copy of the non-resident set
    (:meth:`Replay.clear_carry`); the earlier run's own time less what its
    steps and decode took gives the fixed part (build, shuffle, checks);
    :data:`PROCESS_START_S` adds start-up.
    """
    steps = prior["steps"]

    def series(mode: str) -> dict[int, float]:
        return {int(t): float(e[mode]["median_s"]) for t, e in steps.items() if mode in e}

    times = {m: series(m) for m in ("resident", *POOL_MODES)}
    decode = prior["decode"]
    kinds = _decode_kinds(decode)
    if "phase_s" in prior:
        measured = prior["phase_s"]["steps"] + prior["phase_s"]["decode"]
    else:  # runs 1-3: (reps + 1) single steps per size and mode
        calls = int(next(iter(steps.values()))["host_view"]["reps"]) + 1
        measured = sum(
            calls * float(e[m]["median_s"])
            for e in steps.values()
            for m in ("resident", *POOL_MODES)
            if m in e
        ) + sum(
            _decode_seconds(k, int(decode["samples"]), int(decode["replays_per_sample"]), False)
            for k in kinds.values()
        )
    fixed = float(prior["seconds"]) - measured

    uniform = kinds["uniform"]
    prelude_s = max(uniform["eager"]["on_median_ms"], uniform["eager"]["off_median_ms"]) / 1e3
    clear_s = float(prior["copy_bound_s"])
    step_s = 0.0
    for tokens in plan["sizes"]:
        for mode in plan["modes"][tokens]:
            t = interpolate(times[mode], tokens, proportional_below=mode == "resident")
            warmup = 1 if mode in ("resident", "host_view") else 0
            step_s += (warmup + reps * chunks_per_run) * t
            if mode != "resident":
                step_s += reps * prelude_s
            if mode in ("staged", "staged_sync"):  # clear_carry: one copy of the set
                step_s += reps * clear_s
    decode_s = sum(
        _decode_seconds(kinds.get(k, uniform), decode_iters, decode_replays, True)
        for k in ("uniform", "all_hits")
    )
    total = PROCESS_START_S + fixed + step_s + decode_s
    return {
        "start_s": PROCESS_START_S,
        "fixed_s": fixed,
        "steps_s": step_s,
        "decode_s": decode_s,
        "total_s": total,
    }


def stats_delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """Counter differences of two snapshots of the stager's stats."""
    return {k: after[k] - before.get(k, 0) for k in after}


def count_runs(nonresident: Sequence[bool]) -> int:
    """Contiguous runs of non-resident experts in one layer's residency."""
    return sum(1 for i, n in enumerate(nonresident) if n and (i == 0 or not nonresident[i - 1]))


# ---------------------------------------------------------------------------
# GPU side (torch and vLLM imported lazily: the arithmetic above imports without them)


def _decode_replay() -> ModuleType:
    """``scripts/pool_decode_replay.py`` (layer builder, graph capture, result writer)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import pool_decode_replay

    module: ModuleType = pool_decode_replay
    return module


def _need_stage() -> None:
    try:
        from vllm.model_executor.layers.fused_moe.expert_pool.stage import PrefillStager
    except ImportError as exc:
        sys.exit(f"this vLLM import has no prefill staging (apply dev/staging): {exc}")
    missing = [name for name in ("note_step",) if not hasattr(PrefillStager, name)]
    if missing:
        sys.exit(f"this vLLM's PrefillStager predates issue #18's API (no {', '.join(missing)})")


def replay_vllm_config(widest: int) -> Any:
    """A config whose scheduler allows steps of ``widest`` tokens, so that the pool
    attaches its stager (it attaches none when no step of the config could be staged)."""
    from vllm.config import SchedulerConfig, VllmConfig

    tokens = max(widest, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)
    try:
        scheduler = SchedulerConfig.default_factory(
            max_num_batched_tokens=tokens, max_model_len=tokens
        )
        return VllmConfig(scheduler_config=scheduler)
    except Exception as exc:  # the default config, as runs 1-3 used
        print(f"warning: default VllmConfig ({type(exc).__name__}: {exc})", file=sys.stderr)
        return VllmConfig()


def make_layer_experts(num_experts: int, template: dict[str, Any], seed: int) -> dict[str, Any]:
    """One layer of NVFP4 experts in Marlin layout, on the GPU.

    Weight words are random (every 4-bit code is a valid e2m1 value); scales are
    drawn element-wise from a real quantized template expert, so they are valid
    Marlin scale codes; global scales are the template's. Rows differ, so a wrong
    row would change the output.
    """
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    out: dict[str, Any] = {}
    for name, t in template.items():
        shape = (num_experts, *t.shape)
        if name.endswith("_weight"):
            assert t.dtype == torch.int32, (name, t.dtype)
            out[name] = torch.randint(
                -(2**31), 2**31 - 1, shape, dtype=torch.int32, device="cuda", generator=gen
            )
        elif name.endswith("_scale_2"):
            out[name] = t.expand(shape).contiguous()
        else:
            flat = t.reshape(-1)
            idx = torch.randint(
                0, flat.numel(), (num_experts, flat.numel()), device="cuda", generator=gen
            )
            out[name] = flat[idx].view(shape).contiguous()
    return out


def pinned_copy(t: Any) -> Any:
    """A pinned host copy of a tensor."""
    import torch

    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    out.copy_(t)
    return out


def make_template() -> dict[str, Any]:
    """One real quantized expert (Marlin layout) used for shapes and scale codes."""
    import torch
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        rand_marlin_weight_nvfp4_like,
    )

    torch.manual_seed(0)
    out = {}
    for name, shape in (("w13", (2 * INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
        weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 10
        _, qweight, scales, gscale = rand_marlin_weight_nvfp4_like(weight, 16)
        out[f"{name}_weight"] = qweight
        out[f"{name}_weight_scale"] = scales
        out[f"{name}_weight_scale_2"] = gscale.reshape(())
    return out


def uniform_routes(tokens: int, num_experts: int, gen: Any) -> tuple[Any, Any]:
    """Distinct top-8 experts per token, uniform; softmax router weights."""
    import torch

    scores = torch.rand(tokens, num_experts, device="cuda", generator=gen)
    ids = scores.topk(TOP_K, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.rand(tokens, TOP_K, device="cuda", generator=gen), dim=1)
    return ids.contiguous(), weights.float().contiguous()


# ---------------------------------------------------------------------------
# Measurement helpers


def event_times_ms(work: Callable[[], object], reps: int) -> list[float]:
    """``reps`` calls of ``work``, each between two CUDA events on the current
    stream and waited for: the milliseconds of each (warm up before calling)."""
    import torch

    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def pinned_h2d_bandwidth(nbytes: int, reps: int) -> dict[str, Any]:
    """Pinned host -> device copy bandwidth (GB/s, 1e9 B/s) with CUDA events."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = event_times_ms(lambda: dst.copy_(src, non_blocking=True), reps)
    rates = [nbytes / (ms / 1e3) / 1e9 for ms in times]
    return {
        "bytes": nbytes,
        "reps": reps,
        "gbps_max": max(rates),
        "gbps_median": statistics.median(rates),
    }


class PcieSampler:
    """Integrates NVML PCIe RX throughput (bytes into the GPU) while running."""

    def __init__(self) -> None:
        self.available = False
        self.error: str | None = None
        try:
            from vllm.third_party import pynvml

            pynvml.nvmlInit()
            import torch

            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            pynvml.nvmlDeviceGetPcieThroughput(self._handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
            self.available = True
        except Exception as exc:  # NVML missing or counter unsupported
            self.error = f"{type(exc).__name__}: {exc}"
        self._bytes = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            try:
                kbps = self._nvml.nvmlDeviceGetPcieThroughput(
                    self._handle, self._nvml.NVML_PCIE_UTIL_RX_BYTES
                )
            except Exception:
                return
            now = time.perf_counter()
            self._bytes += kbps * 1024.0 * (now - last)
            last = now

    def __enter__(self) -> PcieSampler:
        self._bytes = 0.0
        if self.available:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    @property
    def bytes(self) -> float | None:
        return self._bytes if self.available else None


# ---------------------------------------------------------------------------
# The replay

_FROM_ARGS: Any = object()  # set_mode's default: the threshold of --min-tokens

Routes = list[tuple[Any, Any]]


class Replay:
    """The pooled layer stack of a replay and the measurements on it.

    ``args`` are this script's options (``experts``, ``rows``, ``layers``,
    ``host_sets``, ``decode_tokens``, ``min_tokens``, ``seed``); ``weight_seed``
    (default ``args.seed``) seeds the expert weights apart from the routes, so
    ranks of a tensor-parallel replay (``scripts/pool_tp_replay.py``) hold
    different shards under the same routes.
    """

    def __init__(self, args: argparse.Namespace, weight_seed: int | None = None) -> None:
        import torch
        from vllm.model_executor.layers.fused_moe.expert_pool import install_expert_pool

        self.args = args
        self.E = args.experts
        self.gen = torch.Generator(device="cuda").manual_seed(args.seed)
        t0 = time.monotonic()
        template = make_template()
        self.row_bytes = {name: t.numel() * t.element_size() for name, t in template.items()}
        # Distinct pinned expert sets, shared round robin by the layers: what is
        # timed depends on bytes moved and computed, not on which bytes they are.
        self.host_sets: list[dict[str, Any]] = []
        seed = args.seed if weight_seed is None else weight_seed
        for k in range(min(args.host_sets, args.layers)):
            experts = make_layer_experts(self.E, template, seed + 1 + k)
            self.host_sets.append({name: pinned_copy(t) for name, t in experts.items()})
            del experts
        pending_layer = _decode_replay().pending_layer
        layers = [
            pending_layer(i, self.host_sets[i % len(self.host_sets)], args.rows, num_experts=self.E)
            for i in range(args.layers)
        ]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.model = torch.nn.ModuleList(layers)
        self.build_s = time.monotonic() - t0
        self.pool = install_expert_pool(self.model, torch.device("cuda"), args.decode_tokens)
        assert self.pool is not None
        self.stager = self.pool.stager
        if self.stager is None:
            raise SystemExit(
                "the pool attached no prefill stager (staging disabled, or the current "
                "config allows no step it would stage)"
            )
        self.pinned_gib = (
            sum(t.numel() * t.element_size() for host in self.host_sets for t in host.values())
            / GIB
        )

    def resident_sets(self) -> list[dict[str, Any]]:
        """Every layer's experts on the GPU (one device copy per distinct host set)."""
        on_gpu = [{n: t.to("cuda") for n, t in host.items()} for host in self.host_sets]
        return [on_gpu[i % len(on_gpu)] for i in range(len(self.pool.layers))]

    def attach(self, on: bool) -> None:
        """Attach the stager to every layer (staging on) or detach it (off)."""
        for layer in self.pool.layers:
            layer.stager = self.stager if on else None

    def stats(self) -> dict[str, int]:
        """A snapshot of the stager's counters (host side, no sync)."""
        stats = self.stager.stats
        if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
            return dataclasses.asdict(stats)
        return dict(vars(stats))

    # -- modes ---------------------------------------------------------------

    def set_mode(self, mode: str, min_tokens: int | None = _FROM_ARGS) -> None:
        """``host_view`` (detached), ``staged_sync`` or ``staged``; ``min_tokens``
        None lets the stager's cost model decide, an int stages every step that wide."""
        if mode not in POOL_MODES:
            raise ValueError(f"unknown mode {mode!r}")
        self.attach(mode != "host_view")
        self.stager.prefetch = mode == "staged"
        self.stager.cross_step = mode == "staged"
        self.stager.min_tokens = self.args.min_tokens if min_tokens is _FROM_ARGS else min_tokens

    def pool_step(self, x: Any, routes: Routes) -> list[Any]:
        """Every pooled layer on ``x`` (no hook: what a CUDA graph captures)."""
        return [
            layer.apply(x, w, ids) for layer, (ids, w) in zip(self.pool.layers, routes, strict=True)
        ]

    def step(self, x: Any, routes: Routes) -> list[Any]:
        """One forward step as the vLLM worker runs it: ``note_step``, then the layers."""
        self.stager.note_step()
        return self.pool_step(x, routes)

    def resident_step(self, x: Any, routes: Routes, resident: list[Any]) -> None:
        resident_moe = _decode_replay().resident_moe
        for t, (ids, w) in zip(resident, routes, strict=True):
            resident_moe(x, t, w, ids, self.E)

    # -- pieces --------------------------------------------------------------

    def decode_input(self) -> tuple[Any, Routes]:
        import torch

        tokens = self.args.decode_tokens
        x = (torch.randn(tokens, HIDDEN, device="cuda", generator=self.gen) / 10).bfloat16()
        return x, [uniform_routes(tokens, self.E, self.gen) for _ in self.pool.layers]

    def shuffle_residency(self, rounds: int) -> dict[str, Any]:
        """Decode steps with the gate open: the global LRU moves rows between layers."""
        import torch

        self.pool.tables.set_gate(True)
        for _ in range(rounds):
            self.step(*self.decode_input())
        torch.cuda.synchronize()
        return self.residency()

    def residency(self) -> dict[str, Any]:
        hot = self.pool.tables.hot_table.cpu().view(self.pool.tables.num_layers, self.E)
        masks = [[v < 0 for v in row] for row in hot.tolist()]
        nonres = [sum(m) for m in masks]
        per_expert = sum(self.row_bytes.values())
        return {
            "nonresident_per_layer": nonres,
            "runs_per_layer": [count_runs(m) for m in masks],
            "nonresident_bytes_per_step": sum(nonres) * per_expert,
        }

    def hostview_bytes_model(self, routes: Routes, tokens: int) -> int:
        """Host-view bytes if Marlin reads each non-resident expert once per M-block."""
        import torch

        per_expert = sum(self.row_bytes.values())
        total = 0
        for layer, (ids, _) in zip(self.pool.layers, routes, strict=True):
            bm = layer.block_size_for(tokens, TOP_K)
            counts = torch.bincount(ids.reshape(-1).long(), minlength=self.E)
            hot = self.pool.tables.hot_slice(layer.index)
            blocks = torch.where(hot < 0, (counts + bm - 1) // bm, torch.zeros_like(counts))
            total += int(blocks.sum().item()) * per_expert
        return total

    def narrow_input(self) -> tuple[Any, Routes]:
        """The narrowest partition step (16 tokens at least): input and routes, made once."""
        import torch

        if getattr(self, "_narrow", None) is None:
            lanes = int(getattr(self.pool, "max_lanes", self.args.decode_tokens * TOP_K))
            tokens = max(16, lanes // TOP_K + 1)
            x = (torch.randn(tokens, HIDDEN, device="cuda", generator=self.gen) / 10).bfloat16()
            routes = [uniform_routes(tokens, self.E, self.gen) for _ in self.pool.layers]
            self._narrow = (x, routes)
        return self._narrow

    def clear_carry(self) -> None:
        """One narrow staged step without the cross-step copy: afterwards the
        buffers hold the last layers, so the next staged step starts with no
        copy of layer 0 in hand (a first step, whatever ran before)."""
        x, routes = self.narrow_input()
        self.set_mode("staged", min_tokens=x.shape[0])
        self.stager.cross_step = False
        self.step(x, routes)

    def uva_copy_bandwidth(self, reps: int, layers: int = 4) -> dict[str, Any]:
        """The rate of the pool's SM-driven copy kernel (``copy_pool_rows``)
        reading host rows through their UVA views: how a copy of only a step's
        routed non-resident rows would have to run, since without a host sync
        only the device knows the routes (issue #18). Each of the first
        ``layers`` layers copies its non-resident rows into one device scratch
        of a layer's rows; bytes over the time of all of them (CUDA events),
        after one untimed pass (the kernel compiles)."""
        import torch
        from vllm.model_executor.layers.fused_moe.expert_pool.bank import copy_pool_rows

        plans = []
        for layer in self.pool.layers[:layers]:
            hot = self.pool.tables.hot_slice(layer.index)
            rows = (hot < 0).nonzero().flatten().to(torch.int32)
            count = torch.tensor([rows.numel()], dtype=torch.int32, device="cuda")
            plans.append((layer.copy_views()[0], rows, count))
        scratch = [torch.empty_like(view) for view in plans[0][0]]
        moved = sum(int(rows.numel()) for _, rows, _ in plans) * sum(self.row_bytes.values())

        def copy_all() -> None:
            for srcs, rows, count in plans:
                copy_pool_rows(srcs, scratch, rows, rows, count)

        copy_all()
        torch.cuda.synchronize()
        rates = [moved / (ms / 1e3) / 1e9 for ms in event_times_ms(copy_all, reps)]
        scratch.clear()
        torch.cuda.empty_cache()
        return {
            "gbps_median": statistics.median(rates),
            "gbps_max": max(rates),
            "bytes_per_pass": moved,
            "layers": len(plans),
            "method": "copy_pool_rows of each layer's non-resident rows from the host "
            "views into a device scratch: bytes / time of all layers",
        }

    def copy_bandwidth(self, reps: int) -> dict[str, Any]:
        """The stager's copy rate: staged steps too narrow to compute much.

        Staging forced (``min_tokens``) at the narrowest partition step, with
        prefetch and without the cross-step copy: every layer's non-resident
        rows, copied back to back while tiny Marlin passes run; bytes from the
        stager's counters over the step's time (CUDA events). The last layer's
        passes after its copy are in the time, so this slightly understates
        the copy rate.
        """
        import torch

        x, routes = self.narrow_input()
        tokens = x.shape[0]
        self.set_mode("staged", min_tokens=tokens)
        self.stager.cross_step = False
        self.step(x, routes)
        rates, moved, copies = [], 0, 0
        for _ in range(reps):
            torch.cuda.synchronize()
            before = self.stats()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            self.step(x, routes)
            end.record()
            end.synchronize()
            delta = stats_delta(self.stats(), before)
            moved, copies = delta["bytes_copied"], delta["copies"]
            rates.append(moved / (start.elapsed_time(end) / 1e3) / 1e9)
        torch.cuda.synchronize()
        self.set_mode("staged")
        return {
            "gbps_median": statistics.median(rates),
            "gbps_max": max(rates),
            "bytes_per_pass": moved,
            "copies_per_pass": copies,
            "tokens": tokens,
            "method": "staged steps of `tokens` tokens, staging forced, prefetch on, "
            "cross-step copy off: bytes copied / step time",
        }

    def correctness(self, tokens: int) -> dict[str, Any]:
        """Staged output vs host-view output of every layer (same inputs)."""
        import torch

        x = (torch.randn(tokens, HIDDEN, device="cuda", generator=self.gen) / 10).bfloat16()
        routes = [uniform_routes(tokens, self.E, self.gen) for _ in self.pool.layers]
        self.set_mode("host_view")
        ref_a = self.step(x, routes)
        ref_b = self.step(x, routes)
        # Staging at small M, where Marlin is bitwise repeatable.
        self.set_mode("staged", min_tokens=tokens)
        before = self.stats()
        staged = self.step(x, routes)
        torch.cuda.synchronize()
        delta = stats_delta(self.stats(), before)
        self.set_mode("staged")
        max_diff = max(
            float((a.float() - b.float()).abs().max()) for a, b in zip(staged, ref_a, strict=True)
        )
        return {
            "tokens": tokens,
            "layers_staged": delta["layers_staged"],
            "unplanned_layers": delta.get("unplanned_layers"),
            "reference_repeatable": all(
                torch.equal(a, b) for a, b in zip(ref_a, ref_b, strict=True)
            ),
            "bitwise_equal": all(torch.equal(a, b) for a, b in zip(staged, ref_a, strict=True)),
            "max_abs_diff": max_diff,
            "finite": all(bool(torch.isfinite(a).all()) for a in staged),
        }

    def chunk_inputs(self, tokens: int, count: int) -> list[tuple[Any, Routes]]:
        """``count`` chunks of ``tokens`` tokens: inputs and uniform routes, each its own."""
        import torch

        return [
            (
                (torch.randn(tokens, HIDDEN, device="cuda", generator=self.gen) / 10).bfloat16(),
                [uniform_routes(tokens, self.E, self.gen) for _ in self.pool.layers],
            )
            for _ in range(count)
        ]

    def chunk_run(
        self,
        mode: str,
        inputs: list[tuple[Any, Routes]],
        resident: list[Any] | None = None,
        sampler: PcieSampler | None = None,
    ) -> dict[str, Any]:
        """One multi-chunk prompt: the chunks back to back, no host sync between them.

        Pool modes start after one synchronized decode step (a prompt arriving
        while others decode), staged modes after :meth:`clear_carry` before
        that; each chunk is ``note_step`` and the layers. Per-step times from
        CUDA events recorded on the compute stream between the chunks; the
        stager's counters are read on the host after each launch (they count
        at issue time).
        """
        import torch

        run_one: Callable[[Any, Routes], Any]
        if mode == "resident":
            assert resident is not None
            run_one = functools.partial(self.resident_step, resident=resident)
        else:
            if mode != "host_view":
                self.clear_carry()
            self.set_mode(mode)
            self.step(*self.decode_input())
            run_one = self.step
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(inputs) + 1)]
        before = after_first = self.stats()
        pcie = sampler if sampler is not None and mode != "resident" else None
        with pcie if pcie is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            events[0].record()
            for i, (x, routes) in enumerate(inputs):
                run_one(x, routes)
                events[i + 1].record()
                if i == 0:
                    after_first = self.stats()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        out: dict[str, Any] = {
            "step_s": [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(events)],
            "wall_s": wall,
        }
        if mode != "resident":
            out["stats"] = stats_delta(self.stats(), before)
            out["first_step_stats"] = stats_delta(after_first, before)
            rx = pcie.bytes if pcie is not None else None
            out["nvml_rx_bytes_per_step"] = None if rx is None else rx / len(inputs)
        return out

    def measure_size(
        self,
        tokens: int,
        modes: Sequence[str],
        chunks_per_run: int,
        reps: int,
        resident: list[Any],
        sampler: PcieSampler,
    ) -> dict[str, Any]:
        """Every mode's multi-chunk runs at one step size, repetitions interleaved."""
        import torch

        inputs = self.chunk_inputs(tokens, chunks_per_run)
        # Warm-up (Marlin's kernel for this width) outside the timed runs.
        self.resident_step(*inputs[0], resident)
        self.set_mode("host_view")
        self.step(*inputs[0])
        torch.cuda.synchronize()
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
        for _ in range(reps):
            for mode in modes:
                runs[mode].append(self.chunk_run(mode, inputs, resident, sampler))
        entry: dict[str, Any] = {"tokens": tokens}
        calls = reps * chunks_per_run
        for mode, done in runs.items():
            m: dict[str, Any] = {
                **aggregate_runs([r["step_s"] for r in done]),
                "reps": reps,
                "chunks": chunks_per_run,
                "runs": done,
            }
            if mode != "resident":
                m["copied_bytes_per_step"] = sum(r["stats"]["bytes_copied"] for r in done) / calls
                m["staged_layers_per_step"] = sum(r["stats"]["layers_staged"] for r in done) / calls
                m["first_step_carried"] = [r["first_step_stats"].get("carried") for r in done]
                rx = [r["nvml_rx_bytes_per_step"] for r in done]
                m["nvml_rx_bytes_median"] = None if None in rx else statistics.median(rx)
            entry[mode] = m
        entry["host_view"]["model_bytes_per_step"] = self.hostview_bytes_model(inputs[0][1], tokens)
        entry["nonresident_bytes"] = self.residency()["nonresident_bytes_per_step"]
        self.set_mode("staged")
        return entry

    def resident_routes(self, tokens: int) -> Routes:
        """Per layer, top-8 routes drawn among the layer's resident experts only."""
        import torch

        out = []
        for layer in self.pool.layers:
            scores = torch.rand(tokens, self.E, device="cuda", generator=self.gen)
            scores[:, self.pool.tables.hot_slice(layer.index) < 0] = -1.0
            ids = scores.topk(TOP_K, dim=1).indices.to(torch.int32).contiguous()
            weights = torch.softmax(
                torch.rand(tokens, TOP_K, device="cuda", generator=self.gen), dim=1
            )
            out.append((ids, weights.float().contiguous()))
        return out

    def decode_counts(self) -> Any:
        """Per layer, the distinct experts hit plus missed by open-gate decode
        steps so far (the pool's device counters, read with a sync)."""
        return self.pool.tables.stats.view(-1, 3)[:, :2].sum(dim=1).cpu()

    def decode(self, iters: int, replays: int) -> dict[str, Any]:
        """Decode steps of the stack with staging on and off.

        On: the stager attached and ``note_step`` called before every step
        (eager step or graph replay), as the vLLM worker does; off: the stager
        detached and no hook, as a server without staging. For two kinds of
        routes - ``uniform`` (the global LRU copies every miss into the bank,
        so copies dominate) and ``all_hits`` (routes among resident experts
        only, so the step is the Marlin passes and the planner) - two
        measurements, on and off interleaved in both: ``graphs`` replays the
        decode step of all layers from CUDA graphs captured once with the
        stager attached and once without (vLLM decodes in graphs under
        FULL_DECODE_ONLY, the seed's setup); each sample is ``replays``
        back-to-back replays timed with CUDA events, fed routes from a cycle of
        :data:`FEED_ROUTES` sets that both modes share. ``eager`` times single
        uncaptured steps by wall clock (host launch overhead included, so it is
        noisier), each with fresh routes, so neither mode runs on rows the
        other just brought in.
        """
        import torch

        capture_graph = _decode_replay().capture_graph
        tokens = self.args.decode_tokens
        x = (torch.randn(tokens, HIDDEN, device="cuda", generator=self.gen) / 10).bfloat16()
        order = ("on", "off")
        kinds = {
            "uniform": lambda: [uniform_routes(tokens, self.E, self.gen) for _ in self.pool.layers],
            "all_hits": lambda: self.resident_routes(tokens),
        }

        def medians(times: dict[str, list[float]]) -> dict[str, Any]:
            skip = min(5, iters // 5)
            on = statistics.median(times["on"][skip:])
            off = statistics.median(times["off"][skip:])
            return {"on_median_ms": on * 1e3, "off_median_ms": off * 1e3, "on_over_off": on / off}

        out: dict[str, Any] = {
            "tokens": tokens,
            "samples": iters,
            "replays_per_sample": replays,
        }
        self.pool.tables.set_gate(True)
        counted = self.decode_counts()
        for kind, make in kinds.items():
            eager: dict[str, list[float]] = {"on": [], "off": []}
            for it in range(iters):
                for mode in order if it % 2 == 0 else order[::-1]:
                    routes = make()
                    self.attach(mode == "on")
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    if mode == "on":
                        self.stager.note_step()
                    self.pool_step(x, routes)
                    torch.cuda.synchronize()
                    eager[mode].append(time.perf_counter() - t0)

            feed = [make() for _ in range(FEED_ROUTES)]
            static = [(ids.clone(), w.clone()) for ids, w in feed[0]]
            graphs = {}
            for mode in order:
                self.attach(mode == "on")
                if mode == "on":
                    self.stager.note_step()
                graphs[mode] = capture_graph(functools.partial(self.pool_step, x, static))
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            replayed: dict[str, list[float]] = {"on": [], "off": []}
            step = 0
            for sample in range(iters):
                for mode in order if sample % 2 == 0 else order[::-1]:
                    note = mode == "on"
                    start.record()
                    for _ in range(replays):
                        for (ids, w), (new_ids, new_w) in zip(
                            static, feed[step % FEED_ROUTES], strict=True
                        ):
                            ids.copy_(new_ids)
                            w.copy_(new_w)
                        if note:
                            self.stager.note_step()
                        graphs[mode].replay()
                        step += 1
                    end.record()
                    end.synchronize()
                    replayed[mode].append(start.elapsed_time(end) / 1e3 / replays)
            graphs.clear()
            out[kind] = {"graphs": medians(replayed), "eager": medians(eager)}
        self.attach(True)
        # The "off" steps changed placement without the hook: tell the stager.
        self.stager.note_step()
        # The goal: graph replays, both kinds of routes; the larger deviation counts.
        ratios = [out[kind]["graphs"]["on_over_off"] for kind in kinds]
        out["on_over_off"] = max(ratios, key=lambda r: abs(r - 1))
        # Every layer's decode path ran (its open-gate counters moved).
        out["decode_path_checked"] = bool((self.decode_counts() > counted).all())
        return out


def ttft_tables(steps: Mapping[str, Any], mode: str) -> tuple[dict[int, float], dict[int, float]]:
    """First-step and steady-state seconds per size of one mode."""
    first, steady = {}, {}
    for key, entry in steps.items():
        m = entry.get(mode)
        if m is None:
            continue
        first[int(key)] = m["first_s"]
        steady[int(key)] = m["steady_s"] if m["steady_s"] is not None else m["first_s"]
    return first, steady


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    data: dict[str, Any] = {"errors": []}
    started = time.monotonic()
    phase: dict[str, float] = {}
    plan = measurement_plan(args.steps, args.sweep, args.remainders)
    bw = pinned_h2d_bandwidth(args.bw_bytes, 5)
    data["pinned_h2d"] = bw
    h2d = bw["gbps_median"]

    rp = Replay(args)
    data["setup"] = {
        "layers": args.layers,
        "experts": args.experts,
        "top_k": TOP_K,
        "hidden": HIDDEN,
        "intermediate_per_partition": INTER,
        "rows_per_layer": args.rows,
        "resident_fraction": min(args.rows, args.experts - 1) / args.experts,
        "row_bytes": rp.row_bytes,
        "expert_bytes": sum(rp.row_bytes.values()),
        "pinned_host_gib": rp.pinned_gib,
        "host_sets": len(rp.host_sets),
        "bank_gib": rp.pool.geometry.total_bytes / GIB,
        "staging_buffers": len(rp.stager.plan.holdings),
        "staging_buffer_gib": rp.stager.buffer_bytes / GIB,
        "min_tokens": args.min_tokens,
        "chunks": args.chunks,
        "reps": args.reps,
        "plan": plan,
        "build_s": rp.build_s,
    }

    # First Marlin call JIT-compiles (no sm_90 SASS in the wheel).
    t0 = time.monotonic()
    rp.set_mode("host_view")
    xs = (torch.randn(16, HIDDEN, device="cuda") / 10).bfloat16()
    rp.step(xs, [uniform_routes(16, args.experts, rp.gen) for _ in rp.pool.layers])
    torch.cuda.synchronize()
    data["first_call_s"] = time.monotonic() - t0

    data["residency"] = rp.shuffle_residency(args.shuffle_rounds)
    nonres_bytes = data["residency"]["nonresident_bytes_per_step"]
    data["copy_bound_s"] = nonres_bytes / (h2d * 1e9)
    data["stager_copy"] = rp.copy_bandwidth(3)
    try:
        data["uva_copy"] = rp.uva_copy_bandwidth(3)
    except Exception as exc:  # a probe for a later design choice: never lose the run to it
        data["errors"].append(f"uva_copy: {exc!r}")
    data["correctness"] = rp.correctness(args.check_tokens)
    phase["setup"] = time.monotonic() - started

    sampler = PcieSampler()
    data["nvml"] = {"available": sampler.available, "error": sampler.error}

    t0 = time.monotonic()
    steps: dict[str, Any] = {}
    resident = rp.resident_sets()
    for tokens in plan["sizes"]:
        entry = rp.measure_size(
            tokens, plan["modes"][tokens], args.chunks, args.reps, resident, sampler
        )
        entry["main"] = tokens in plan["main"]
        steps[str(tokens)] = entry
    del resident
    torch.cuda.empty_cache()
    phase["steps"] = time.monotonic() - t0
    data["steps"] = steps
    data["stager_stats"] = rp.stats()
    data["stager_checks"] = {
        "unplanned_layers": data["stager_stats"].get("unplanned_layers"),
        "ok": data["stager_stats"].get("unplanned_layers") == 0,
    }

    # TTFT (MoE stack only) from per-step times.
    floors = {
        int(k): floor_s(e["resident"]["median_s"], e["nonresident_bytes"], h2d)
        for k, e in steps.items()
    }
    ttft: dict[str, Any] = {}
    for s in plan["main"]:
        for label, prompt in PROMPTS.items():
            ttft[f"floor_{s}_{label}"] = ttft_s(prompt, s, floors, floors)
            for mode in POOL_MODES:
                first, steady = ttft_tables(steps, mode)
                ttft[f"{mode}_{s}_{label}"] = ttft_s(prompt, s, first, steady)
    data["ttft_moe_only"] = ttft

    def ratio(a: str, b: str) -> float | None:
        if a in ttft and b in ttft:
            return float(ttft[a]["seconds"]) / float(ttft[b]["seconds"])
        return None

    seed = SEED_TTFT_S
    comparisons = []
    for label in PROMPTS:
        comparisons += [
            {
                "what": f"host view 4096 / staged 4608, {label}",
                "seed": seed["host_view_4096"][label] / seed["staged_8192_eff_4608"][label],
                "ours": ratio(f"host_view_4096_{label}", f"staged_4608_{label}"),
            },
            {
                "what": f"host view 4096 / staged sync 4096, {label}",
                "seed": seed["host_view_4096"][label] / seed["staged_sync_4096"][label],
                "ours": ratio(f"host_view_4096_{label}", f"staged_sync_4096_{label}"),
            },
            {
                "what": f"staged sync / staged prefetch at 4608, {label}",
                "seed": seed["staged_sync_8192_eff_4608"][label]
                / seed["staged_8192_eff_4608"][label],
                "ours": ratio(f"staged_sync_4608_{label}", f"staged_4608_{label}"),
            },
        ]
    data["seed_comparison"] = {
        "seed_ttft_s": SEED_TTFT_S,
        "seed_note": SEED_NOTE,
        "ratios": comparisons,
    }

    t0 = time.monotonic()
    data["decode"] = rp.decode(args.decode_iters, args.decode_replays)
    phase["decode"] = time.monotonic() - t0

    per_size = {}
    for tokens in plan["summary"]:
        e = steps[str(tokens)]
        per_size[tokens] = {
            "resident_s": e["resident"]["median_s"],
            "nonresident_bytes": e["nonresident_bytes"],
            "staged": e["staged"],
            "host_view": e["host_view"],
        }
    rows = summary_rows(args.experts, per_size, h2d)
    data["summary_rows"] = rows
    key = f"_{TTFT_STEP}_{TTFT_PROMPT}"
    ttft_goal = None
    if f"staged{key}" in ttft:
        ttft_goal = {
            "staged_s": ttft[f"staged{key}"]["seconds"],
            "host_view_s": ttft[f"host_view{key}"]["seconds"],
            "floor_s": ttft[f"floor{key}"]["seconds"],
        }
    data["goals"] = goal_checks(
        rows,
        experts=args.experts,
        sweep_sizes=plan["sweep"],
        ttft=ttft_goal,
        decode_on_over_off=data["decode"]["on_over_off"],
    )
    check = data["correctness"]
    data["correctness_ok"] = (
        check["finite"]
        and check["layers_staged"] == args.layers
        and (check["bitwise_equal"] or not check["reference_repeatable"])
    )
    data["phase_s"] = phase
    data["seconds"] = time.monotonic() - started
    return data


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f}"


def print_table(data: dict[str, Any]) -> None:
    print(
        f"pinned H2D {data['pinned_h2d']['gbps_median']:.1f} GB/s; "
        f"stager copies {data['stager_copy']['gbps_median']:.1f} GB/s; "
        f"non-resident {data['residency']['nonresident_bytes_per_step'] / GIB:.2f} GiB/step"
    )
    if "uva_copy" in data:
        print(f"copy kernel through the host view {data['uva_copy']['gbps_median']:.1f} GB/s")
    for error in data.get("errors", []):
        print(f"error: {error}")
    print("ms per step: first step / steady state (mean of steps 2..N)")
    print(
        f"{'tokens':>7} {'resident':>9} {'host view':>15} {'staged':>15} {'sync':>9} "
        f"{'host/stg':>8} {'stg/floor':>9} {'staged GiB':>10} {'host GiB*':>9} {'nvml GiB':>8}"
    )
    h2d = data["pinned_h2d"]["gbps_median"]
    for key, e in data["steps"].items():
        res = e["resident"]["median_s"]
        host, stg = e["host_view"], e["staged"]
        sync = e.get("staged_sync", {}).get("steady_s")
        floor = floor_s(res, e["nonresident_bytes"], h2d)
        host_s, staged_s = host["median_s"], stg["median_s"]
        nv = host["nvml_rx_bytes_median"]
        print(
            f"{key:>7} {_ms(res):>9} {_ms(host['first_s']):>7}/{_ms(host['steady_s']):<7} "
            f"{_ms(stg['first_s']):>7}/{_ms(stg['steady_s']):<7} {_ms(sync):>9} "
            f"{host_s / staged_s:>8.2f} {staged_s / floor:>9.3f} "
            f"{stg['copied_bytes_per_step'] / GIB:>10.2f} "
            f"{host['model_bytes_per_step'] / GIB:>9.2f} "
            f"{(nv / GIB) if nv is not None else float('nan'):>8.2f}"
        )
    print("(* host GiB: model, one read per Marlin M-block; floor: max(resident, copy bound))")
    for name, t in data["ttft_moe_only"].items():
        if name.endswith(TTFT_PROMPT) and f"_{TTFT_STEP}_" in name:
            print(f"  TTFT {name}: {t['seconds']:.2f} s ({t['steps']} steps)")
    for c in data["seed_comparison"]["ratios"]:
        ours = c["ours"]
        print(
            f"  {c['what']:<44} seed {c['seed']:.2f}  ours {ours:.2f}"
            if ours
            else f"  {c['what']:<44} seed {c['seed']:.2f}  ours n/a"
        )
    d = data["decode"]
    for kind in ("uniform", "all_hits"):
        for how in ("graphs", "eager"):
            m = d[kind][how]
            print(
                f"decode {d['tokens']} tokens, {kind} routes ({how}): "
                f"on {m['on_median_ms']:.3f} ms, off {m['off_median_ms']:.3f} ms"
            )
    c = data["correctness"]
    print(
        f"staged vs host view: bitwise {c['bitwise_equal']} (reference repeatable "
        f"{c['reference_repeatable']}), max abs diff {c['max_abs_diff']:.3g}"
    )
    print(f"stager: unplanned layers {data['stager_checks']['unplanned_layers']}")
    for g in data["goals"]:
        value = g.get("value")
        shown = f" ({value:.3f})" if isinstance(value, float) else ""
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[g["pass"]]
        print(f"  [{verdict}] {g['goal']}{shown}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="result folder (required unless --dry-run)")
    parser.add_argument(
        "--summary",
        type=Path,
        default=None,
        help="an earlier summary.json (another shape's run) to merge this run's rows into; "
        "default OUT/summary.json; the merged summary is written to OUT/summary.json",
    )
    parser.add_argument("--quick", action="store_true", help="4 layers, 4608 only, no sweep")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the measurement plan (and, with --estimate-from, the run time); no GPU",
    )
    parser.add_argument(
        "--estimate-from",
        type=Path,
        default=None,
        help="a staging_replay.json of the same shape whose step times the estimate uses",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=42,
        help="MoE layers (default: the seed model's pooled layers as inferred in SERIES.md)",
    )
    parser.add_argument(
        "--host-sets",
        type=int,
        default=8,
        help="distinct pinned expert sets, shared round robin by the layers",
    )
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rows", type=int, default=192, help="pool rows per layer")
    parser.add_argument("--steps", type=int, nargs="+", default=list(GOAL_SIZES))
    parser.add_argument("--no-remainders", dest="remainders", action="store_false")
    parser.add_argument(
        "--sweep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure " + ", ".join(str(t) for t in SWEEP_SIZES) + " tokens",
    )
    parser.add_argument(
        "--chunks", type=int, default=4, help="consecutive steps per multi-chunk run"
    )
    parser.add_argument("--reps", type=int, default=2, help="multi-chunk runs per size and mode")
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        help="stage every step of at least this many tokens (default: the stager's cost model)",
    )
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--decode-iters", type=int, default=50, help="decode samples per mode")
    parser.add_argument("--decode-replays", type=int, default=5, help="graph replays per sample")
    parser.add_argument("--shuffle-rounds", type=int, default=12)
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument("--bw-bytes", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers = min(args.layers, 4)
        args.steps = [4608]
        args.sweep = False
        args.chunks = 3
        args.reps = 1
        args.decode_iters = 60
        args.shuffle_rounds = 6
        args.bw_bytes = 512 << 20
    if args.chunks < 1 or args.reps < 1:
        parser.error("--chunks and --reps must be at least 1")
    if args.out is None and not args.dry_run:
        parser.error("--out is required")
    return args


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    """The plan, and the estimated run time when an earlier result is given."""
    plan = measurement_plan(args.steps, args.sweep, args.remainders)
    out: dict[str, Any] = {"plan": plan, "chunks": args.chunks, "reps": args.reps}
    if args.estimate_from is not None:
        prior = json.loads(args.estimate_from.read_text())
        prior_data = prior.get("data", prior)
        shape = prior_data["setup"]
        if (shape["experts"], shape["rows_per_layer"], shape["layers"]) != (
            args.experts,
            args.rows,
            args.layers,
        ):
            out["warning"] = (
                f"{args.estimate_from} is {shape['layers']} layers x {shape['experts']} "
                f"experts, {shape['rows_per_layer']} rows; this plan is {args.layers} x "
                f"{args.experts}, {args.rows}"
            )
        out["estimate"] = estimate_seconds(
            prior_data,
            plan,
            chunks_per_run=args.chunks,
            reps=args.reps,
            decode_iters=args.decode_iters,
            decode_replays=args.decode_replays,
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps(dry_run(args), indent=2))
        return 0
    _need_stage()
    from vllm.config import set_current_vllm_config

    widest = max(measurement_plan(args.steps, args.sweep, args.remainders)["sizes"])
    data: dict[str, Any]
    with set_current_vllm_config(replay_vllm_config(widest)):
        try:
            data = run(args)
        except Exception as exc:
            data = {"failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    path = _decode_replay().write_result(args.out, "staging_replay", data)
    print(f"wrote {path}")
    if "failed" in data:
        print(data["traceback"])
        return 1
    provenance = json.loads(path.read_text())["provenance"]
    summary, notes = write_summary(
        args.out / "summary.json", data["summary_rows"], provenance, args.summary
    )
    print(f"wrote {summary}" + "".join(f"; {n}" for n in notes))
    print_table(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
