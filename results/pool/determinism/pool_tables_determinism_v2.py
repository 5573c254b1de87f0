"""Do the expert pool's placement tables evolve the same way twice on one GPU?

Runs only against series whose 0001 still has the torch planner (series hash
9b1eedf3c5ae and earlier); since the serving-width 0001 (2026-12-01), 0001 keeps no planner but the
fused one, and tests/kernels/expert_pool/test_pool_marlin_cuda.py
(test_fused_planner_matches_reference_at_model_scale) checks it step for step
against the reference planner in tests/. Kept as the provenance of its results.

    PYTHONPATH=.:<vllm tree> python3 scripts/pool_tables_determinism.py --out DIR \\
        [--experts 256 --rows 192] [--runs 3]

Builds the layer stack of ``scripts/staging_replay.py`` and runs ``--rounds``
decode rounds through all layers with the LRU gate open, with the same inputs
and routes every time (one seed), snapshotting the placement tables
(residency, owners, stamps, clock) after every layer step; then frees
everything, builds the stack again and repeats, ``--runs`` times in all.
Tensor-parallel ranks see identical routes and must end with identical tables
(``scripts/pool_tp_replay.py`` checks that across two GPUs); this separates
the planner's own determinism from anything between devices.

At the first step where a later run differs from the first, it records what
differs and replays that step's planner ``--replans`` times on copies of the
tables as they were before the step (the same in both runs), counting the
distinct outcomes, and once with the torch reference planner on the CPU. The
inputs and outcomes of that step go to ``first_divergence_run<N>.pt`` for
offline study. Writes ``pool_tables_determinism.json`` (harness result schema).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import traceback
from pathlib import Path
from typing import Any

from pool_decode_replay import write_result  # same folder: sys.path[0]
from staging_replay import HIDDEN, Replay, uniform_routes

STATE = ("hot", "owner", "stamp", "clock", "gate", "error")


def state(tables: Any) -> dict[str, Any]:
    """The whole placement state, on the CPU."""
    return {name: getattr(tables, name).cpu() for name in STATE}


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per table: entries that differ between two states, and the first few."""
    out: dict[str, Any] = {}
    for name in STATE:
        index = (a[name] != b[name]).nonzero().flatten()
        if index.numel():
            out[name] = {
                "entries_differing": index.numel(),
                "first": [
                    {"index": i, "values": [int(a[name][i]), int(b[name][i])]}
                    for i in index[:8].tolist()
                ],
            }
    return out


def key(s: dict[str, Any]) -> bytes:
    return b"".join(s[name].numpy().tobytes() for name in STATE)


def replan(
    rp: Any, layer: Any, before: dict[str, Any], ids: Any, w: Any, times: int
) -> dict[str, Any]:
    """The step's planner on copies of the pre-step tables: outcomes, and the reference."""
    from vllm.model_executor.layers.fused_moe.expert_pool.planner import (
        plan_decode_step_fused,
    )
    from vllm.model_executor.layers.fused_moe.expert_pool.tables import plan_decode_step

    tables = rp.pool.tables
    outcomes: dict[bytes, int] = {}
    states = []
    for _ in range(times):
        copy = dataclasses.replace(
            tables, **{name: before[name].to(tables.hot.device) for name in STATE}
        )
        plan_decode_step_fused(
            copy, layer.index, ids, w, rp.pool.max_lanes, layer.block_size_for(*ids.shape)
        )
        after = state(copy)
        k = key(after)
        if k not in outcomes:
            states.append(after)
        outcomes[k] = outcomes.get(k, 0) + 1
    cpu = dataclasses.replace(tables, **{name: before[name].clone() for name in STATE})
    plan_decode_step(cpu, layer.index, ids.cpu(), w.cpu(), rp.pool.max_lanes)
    reference = state(cpu)
    return {
        "replans": times,
        "distinct_outcomes": len(outcomes),
        "outcome_counts": sorted(outcomes.values(), reverse=True),
        "reference_matches_outcome": [key(s) == key(reference) for s in states],
        "outcomes": states,
        "reference": reference,
    }


def run(
    args: argparse.Namespace, first: list[Any] | None, number: int = 1
) -> tuple[list[Any], dict[str, Any]]:
    """One freshly built stack through all decode steps.

    Returns the per-step ``(ids, tables after)`` and, when ``first`` (the first
    run's steps) is given, where this run first differs from it.
    """
    import torch

    rp = Replay(args)
    tables = rp.pool.tables
    tables.set_gate(True)
    tokens = args.decode_tokens
    x = (torch.randn(tokens, HIDDEN, device="cuda", generator=rp.gen) / 10).bfloat16()
    steps: list[Any] = []
    found: dict[str, Any] = {"identical": True}
    before = state(tables)
    layer: Any = None
    for round_ in range(args.rounds):
        for layer in rp.pool.layers:
            ids, w = uniform_routes(tokens, rp.E, rp.gen)
            layer.apply(x, w, ids)
            after = state(tables)
            k = len(steps)
            steps.append((ids.cpu(), after))
            if first is not None and found["identical"] and key(after) != key(first[k][1]):
                found = {
                    "identical": False,
                    "step": k,
                    "round": round_,
                    "layer": layer.index,
                    "same_routes": bool(torch.equal(ids.cpu(), first[k][0])),
                    "first_vs_this": diff(first[k][1], after),
                }
                probe = replan(rp, layer, before, ids, w, args.replans)
                found["replan"] = {
                    n: v for n, v in probe.items() if n not in ("outcomes", "reference")
                }
                found["first_run_outcome_seen"] = any(
                    key(s) == key(first[k][1]) for s in probe["outcomes"]
                )
                found["reference_vs_first_run"] = diff(probe["reference"], first[k][1])
                found["reference_vs_this_run"] = diff(probe["reference"], after)
                torch.save(
                    {
                        "before": before,
                        "ids": ids.cpu(),
                        "weights": w.cpu(),
                        "layer": layer.index,
                        "first_run_after": first[k][1],
                        "this_run_after": after,
                        "replan_outcomes": probe["outcomes"],
                        "reference_after": probe["reference"],
                        "max_lanes": rp.pool.max_lanes,
                        "block_size": layer.block_size_for(*ids.shape),
                    },
                    args.out / f"first_divergence_run{number}.pt",
                )
            before = after
    # The pool and its stager reference each other: free the cycle before the
    # next build, or two banks are alive at once.
    del rp, tables, layer
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return steps, found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rows", type=int, default=192, help="pool rows per layer")
    parser.add_argument("--layers", type=int, default=42)
    parser.add_argument("--host-sets", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--runs", type=int, default=3, help="builds of the stack, compared")
    parser.add_argument("--replans", type=int, default=20)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from vllm.config import VllmConfig, set_current_vllm_config

    data: dict[str, Any]
    try:
        with set_current_vllm_config(VllmConfig()):
            args.out.mkdir(parents=True, exist_ok=True)
            first, _ = run(args, None)
            later = [run(args, first, n)[1] for n in range(2, args.runs + 1)]
        data = {
            "steps": len(first),
            "later_runs": later,
            "identical": all(r["identical"] for r in later),
            "setup": {**vars(args), "out": str(args.out)},
        }
    except Exception as exc:
        data = {"failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    path = write_result(args.out, "pool_tables_determinism", data)
    print(f"wrote {path}")
    if "failed" in data:
        print(data["traceback"])
        return 1
    for index, found in enumerate(data["later_runs"], 2):
        if found["identical"]:
            print(f"run {index}: identical to run 1 over {data['steps']} steps")
            continue
        replans = found["replan"]
        print(
            f"run {index}: first differs at step {found['step']} (round {found['round']}, "
            f"layer {found['layer']}), same routes {found['same_routes']}; differing "
            f"{ {n: d['entries_differing'] for n, d in found['first_vs_this'].items()} }; "
            f"{replans['replans']} replans of that step gave {replans['distinct_outcomes']} "
            f"outcome(s) {replans['outcome_counts']}, reference matches "
            f"{replans['reference_matches_outcome']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
