"""Pipeline model of a staged prefill step, from a staging replay's result file.

    python3 scripts/staging_pipeline_model.py results/staging/staging_replay_run3.json \\
        [--out results/staging/pipeline_model_run3.json]

The issue's first staging goal bounds a staged step by ``max(sum of compute,
sum of copies)``, which assumes the copies overlap the compute perfectly as a
whole. A step runs the MoE layers in order, though. Each pooled layer runs
its bank pass (resident experts, no copy needed) and then its staged pass,
which has to wait for the copy of that layer's non-resident rows. With
per-layer copy times ``c_k``, bank-pass times ``b_k`` and staged-pass times
``s_k`` this gives two sharper numbers:

* ``double_buffer``: the stager of series commit 0004, simulated: two buffers
  that alternate by layer, the copy of layer ``k`` starts when the copy of
  layer ``k - 1`` is done and the staged pass of layer ``k - 2`` (the last
  reader of its buffer) has run;
* ``in_order``: no staging that copies layers in order, with any number of
  buffers, beats ``max_j (sum_(k<=j) c_k + s_j + sum_(k>j) (b_k + s_k))``:
  the staged pass of layer ``j`` cannot start before the copies of layers
  ``0..j`` are done, and the layers after ``j`` still have to compute.

Inputs, all from the same replay run: ``c_k`` is layer ``k``'s non-resident
bytes at the stager's own measured copy rate (so it includes the per-copy
overhead); the all-resident step time is split evenly over the layers (same
shape, same number of routed tokens) and, within a layer, between the two
passes in proportion to its non-resident experts (uniform routes). Nothing
here runs on a GPU; the output keeps the measured run's provenance and names
this command.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def double_buffer_s(copy: list[float], bank: list[float], staged: list[float]) -> float:
    """Two alternating buffers: event simulation of one step."""
    copy_end: list[float] = []
    staged_end: list[float] = []
    compute = 0.0
    for k, c in enumerate(copy):
        start = copy_end[-1] if copy_end else 0.0
        if k >= 2:
            start = max(start, staged_end[k - 2])
        copy_end.append(start + c)
        compute = max(compute + bank[k], copy_end[k]) + staged[k]
        staged_end.append(compute)
    return compute


def in_order_s(copy: list[float], bank: list[float], staged: list[float]) -> float:
    """Lower bound of any in-order staging, whatever its number of buffers."""
    after = [sum(bank[j + 1 :]) + sum(staged[j + 1 :]) for j in range(len(copy))]
    return max(
        sum(bank) + sum(staged),
        *(sum(copy[: j + 1]) + staged[j] + after[j] for j in range(len(copy))),
    )


def model(run: dict[str, Any]) -> dict[str, Any]:
    """Per main step size: the goal's bound, the two pipeline numbers, and the measurement."""
    data = run["data"]
    per_layer = data["residency"]["nonresident_per_layer"]
    expert_bytes = data["setup"]["expert_bytes"]
    experts = data["setup"]["experts"]
    rate = data["stager_copy"]["gbps_median"] * 1e9
    copy = [n * expert_bytes / rate for n in per_layer]
    out: dict[str, Any] = {
        "layers": len(per_layer),
        "stager_copy_gbps": rate / 1e9,
        "copy_sum_at_stager_rate_s": sum(copy),
        "goal_copy_bound_s": data["copy_bound_s"],
        "steps": {},
    }
    for tokens, entry in data["steps"].items():
        if "resident" not in entry:
            continue
        resident = entry["resident"]["median_s"]
        layer_s = resident / len(per_layer)
        staged_pass = [layer_s * n / experts for n in per_layer]
        bank_pass = [layer_s - p for p in staged_pass]
        goal_bound = max(resident, data["copy_bound_s"])
        staged = entry["staged"]["median_s"]
        out["steps"][tokens] = {
            "resident_s": resident,
            "goal_bound_s": goal_bound,
            "double_buffer_s": double_buffer_s(copy, bank_pass, staged_pass),
            "in_order_s": in_order_s(copy, bank_pass, staged_pass),
            "staged_s": staged,
            "staged_over_goal_bound": staged / goal_bound,
            "in_order_over_goal_bound": in_order_s(copy, bank_pass, staged_pass) / goal_bound,
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a staging_replay.json result file")
    parser.add_argument("--out", type=Path, help="also write the model as a result file here")
    args = parser.parse_args()
    run = json.loads(args.result.read_text())
    if run.get("kind") != "staging_replay":
        sys.exit(f"{args.result} is not a staging replay result (kind {run.get('kind')!r})")
    result = model(run)
    print(
        f"{result['layers']} layers; copies at the stager's {result['stager_copy_gbps']:.1f} GB/s "
        f"take {result['copy_sum_at_stager_rate_s'] * 1e3:.1f} ms; the goal's copy bound is "
        f"{result['goal_copy_bound_s'] * 1e3:.1f} ms"
    )
    print(
        f"{'tokens':>7} {'resident':>9} {'goal bnd':>9} {'2 buffers':>9} {'in order':>9} "
        f"{'measured':>9} {'meas/bnd':>8} {'order/bnd':>9}"
    )
    for tokens, s in result["steps"].items():
        print(
            f"{tokens:>7} {s['resident_s'] * 1e3:>7.1f}ms {s['goal_bound_s'] * 1e3:>7.1f}ms "
            f"{s['double_buffer_s'] * 1e3:>7.1f}ms {s['in_order_s'] * 1e3:>7.1f}ms "
            f"{s['staged_s'] * 1e3:>7.1f}ms {s['staged_over_goal_bound']:>8.3f} "
            f"{s['in_order_over_goal_bound']:>9.3f}"
        )
    if args.out:
        sys.path.insert(0, str(ROOT))
        from harness import results as harness_results

        source = args.result.resolve()
        shown = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source
        prov = dict(run["provenance"])
        prov["measured_by"] = prov["command"]
        prov["command"] = shlex.join([Path(sys.executable).name, *sys.argv])
        prov["derived_from"] = str(shown)
        path = harness_results.write(args.out, "staging_pipeline_model", result, prov)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
