"""The pool's fused decode planner against its torch planner, step for step, at model scale.

Runs only against series whose 0001 still has the torch planner (series hash
9b1eedf3c5ae and earlier); since the serving-width 0001 (2026-12-01), 0001 keeps no planner but the
fused one, and tests/kernels/expert_pool/test_pool_marlin_cuda.py
(test_fused_planner_matches_reference_at_model_scale) checks it step for step
against the reference planner in tests/. Kept as the provenance of its results.

    PYTHONPATH=.:<vllm tree> python3 scripts/planner_race_check.py --out DIR

Allocates only the placement tables of a GLM-like pool (``--layers`` layers x
``--experts`` experts, ``--rows`` rows per layer; no bank), opens the LRU
gate, and feeds the same random 8-token decode routes to the fused Triton
planner and to the torch planner, comparing the tables after every step (the
loop of ``test_fused_planner_matches_torch_planner_at_model_scale`` in series
commit 0001). It does this for the planner as installed and for a copy of its
kernel with the barrier between reading and writing the LRU clock taken out
(the form before that fix), compiled from the installed source. After a
mismatch the fused tables are reset to the torch planner's, so every step is
compared from the same state. Writes ``planner_race_check.json``.

Only entries with a meaning are compared (:func:`meaningful`): ``hot``,
``owner`` and ``stamp`` end in a scatter sink that masked writes go to, and
the torch planner writes its sink every step while the fused one does not, so
whole-table comparisons differ on every step whatever the planner does.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path
from typing import Any

from pool_decode_replay import write_result  # same folder: sys.path[0]

BARRIER = "    tl.debug_barrier()\n    tl.store(clock_ptr, now)\n"
TABLES = ("hot", "owner", "stamp", "clock")


def meaningful(tables: Any) -> dict[str, Any]:
    """The entries of each placement table that carry state, without the scatter sinks.

    ``hot`` is ``[L * E + 1]`` and ``owner``/``stamp`` are ``[P + S + 1]``;
    their last element only absorbs masked writes. Works on torch tensors and
    on NumPy arrays alike.
    """
    keys = tables.num_layers * tables.num_experts
    rows = tables.pool_rows + tables.staging_rows
    return {
        "hot": tables.hot[:keys],
        "owner": tables.owner[:rows],
        "stamp": tables.stamp[:rows],
        "clock": tables.clock,
    }


def differing_entries(fused: Any, expected: Any) -> dict[str, int]:
    """How many meaningful entries of each table differ between two planners' tables."""
    ours, theirs = meaningful(fused), meaningful(expected)
    return {name: int((ours[name] != theirs[name]).sum()) for name in TABLES}


def without_clock_barrier(workdir: Path) -> Any:
    """The installed planner module with the clock barrier removed, as a new module."""
    from vllm.model_executor.layers.fused_moe.expert_pool import planner as kernels

    source = inspect.getsource(kernels)
    if source.count(BARRIER) != 1:
        raise SystemExit("the installed planner has no clock barrier to take out")
    path = workdir / "planner_without_clock_barrier.py"
    path.write_text(source.replace(BARRIER, "    tl.store(clock_ptr, now)\n"))
    spec = importlib.util.spec_from_file_location("planner_without_clock_barrier", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(plan_fused: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Fused vs torch planner over ``--rounds`` rounds of all layers."""
    import torch
    from vllm.model_executor.layers.fused_moe.expert_pool.tables import (
        allocate_tables,
        plan_decode_step,
    )

    top_k = tokens = 8
    lanes = tokens * top_k
    fused = allocate_tables(args.layers, args.experts, args.rows, lanes, "cuda")
    expected = allocate_tables(args.layers, args.experts, args.rows, lanes, "cuda")
    fused.set_gate(True)
    expected.set_gate(True)
    gen = torch.Generator().manual_seed(args.seed)
    weights = torch.full((tokens, top_k), 1.0 / top_k, device="cuda")
    mismatches: list[dict[str, Any]] = []
    steps = args.rounds * args.layers
    for step in range(steps):
        scores = torch.rand(tokens, args.experts, generator=gen)
        ids = scores.topk(top_k, dim=1).indices.to(torch.int32).cuda()
        layer = step % args.layers
        plan_fused(fused, layer, ids, weights, lanes, 8)
        plan_decode_step(expected, layer, ids, weights, lanes)
        differing = differing_entries(fused, expected)
        if any(differing.values()):
            rows = fused.pool_rows + fused.staging_rows
            index = (fused.stamp[:rows] != expected.stamp[:rows]).nonzero().flatten()[:4]
            mismatches.append(
                {
                    "step": step,
                    "differing": differing,
                    "stamps_fused_vs_torch": [
                        [int(fused.stamp[i]), int(expected.stamp[i])] for i in index
                    ],
                    "clock": int(expected.clock[0]),
                }
            )
            for name in TABLES:
                getattr(fused, name).copy_(getattr(expected, name))
    return {"steps": steps, "mismatching_steps": len(mismatches), "first": mismatches[:8]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=42)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rows", type=int, default=192, help="pool rows per layer")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from vllm.model_executor.layers.fused_moe.expert_pool.planner import (
        plan_decode_step_fused,
    )

    data: dict[str, Any] = {"setup": {**vars(args), "out": str(args.out)}}
    data["installed"] = compare(plan_decode_step_fused, args)
    with tempfile.TemporaryDirectory() as tmp:
        unfixed = without_clock_barrier(Path(tmp))
        data["without_clock_barrier"] = compare(unfixed.plan_decode_step_fused, args)
    path = write_result(args.out, "planner_race_check", data)
    print(f"wrote {path}")
    for variant in ("installed", "without_clock_barrier"):
        entry = data[variant]
        print(
            f"{variant}: {entry['mismatching_steps']} of {entry['steps']} steps differ "
            f"from the torch planner; first: {entry['first'][:2]}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
