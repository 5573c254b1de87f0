"""Layer-level replay of the expert pool at serving width (issue #17 goals).

Synthetic NVFP4 MoE layers of a GLM-like shape (hidden 4096, intermediate 1024
per rank, 256 experts, top-8, ``--rows`` rows per layer, default 192), real
Marlin, every step of all layers replayed from one CUDA graph, as in
``scripts/pool_decode_replay.py`` (whose helpers this script reuses). Three
parts, all in one process and well within one 10-minute device call:

1. ``all_resident``: for 1, 8, 32 and 64 tokens per step, one decode step of
   all layers with every expert on the GPU (stock ``fused_marlin_moe``) and
   the same step through the pool with every route resident (routes drawn
   from each layer's resident experts). Goal: pool <= 1.05x resident.
2. ``hit_rate``: for 32 and 64 tokens per step, the pool under a skewed
   router (Zipf s=1 over a per-layer permutation of the experts), gate open,
   for each promotion bound in ``--bounds`` (``0`` = none: every miss is
   promoted). The pool's hit rate comes from its own device counters; an
   offline LRU simulation over the same routes with the same bound (plain
   Python, written independently of the planner: a global LRU list of
   (layer, expert) keys, rows used in a step never evicted, misses
   promoted most-routed first up to the bound) gives the expected one. Goal:
   within 3 points, after the warm-up steps and over all steps.
3. ``planner_cost``: at 1, 8, 32, 64 (and 256) tokens per step, all-hit
   routes, the planner launches and the copy launches of all layers captured
   as their own graph and compared with the all-resident MoE step of part 1.
   Goal at 64 tokens: <= 5% of the all-resident MoE time.

Usage (the device runs it from the repository root, after the bundle's
install; see docs/device-bundle.md)::

    python3 scripts/pool_serving_replay.py --out $OUT [--layers 8 --steps 100]

Writes ``pool_serving_replay.json`` (harness result schema) to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pool_decode_replay as base

HIDDEN, INTER, EXPERTS, TOP_K = base.HIDDEN, base.INTER, base.EXPERTS, base.TOP_K


def zipf_probs(layers: int, gen: Any) -> list[Any]:
    """Per layer, Zipf(s=1) popularity over a random permutation of experts."""
    import torch

    ranks = 1.0 / torch.arange(1, EXPERTS + 1, dtype=torch.float64)
    return [ranks[torch.argsort(torch.randperm(EXPERTS, generator=gen))] for _ in range(layers)]


def routes_from(probs: list[Any], steps: int, tokens: int, gen: Any) -> Any:
    """``[steps, layers, tokens, TOP_K]`` int32: distinct experts per token."""
    import torch

    out = torch.empty(steps, len(probs), tokens, TOP_K, dtype=torch.int32)
    for s in range(steps):
        for layer, p in enumerate(probs):
            out[s, layer] = torch.multinomial(
                p.expand(tokens, -1), TOP_K, replacement=False, generator=gen
            ).to(torch.int32)
    return out


def resident_routes(steps: int, layers: int, tokens: int, slots: int, gen: Any) -> Any:
    """Routes drawn from each layer's initial resident experts (all hits)."""
    import torch

    probs = torch.ones(slots, dtype=torch.float64)
    out = torch.empty(steps, layers, tokens, TOP_K, dtype=torch.int32)
    for s in range(steps):
        for layer in range(layers):
            out[s, layer] = torch.multinomial(
                probs.expand(tokens, -1), TOP_K, replacement=False, generator=gen
            ).to(torch.int32)
    return out


def simulate_lru(routes: list, layers: int, slots: int, bound: int, warmup: int) -> dict[str, Any]:
    """Offline global LRU over (layer, expert) keys with ``layers * slots``
    rows, initially experts ``0..slots-1`` of every layer (layer-major, the
    order the pool fills its rows). Per layer step: hits are refreshed;
    misses, most-routed first (ties by id), take the least recently used key
    not used in this step, at most ``bound`` of them (0 = no bound); the
    other misses are served for that step only."""
    lru: OrderedDict = OrderedDict(
        ((layer, e), None) for layer in range(layers) for e in range(slots)
    )
    hits = misses = promoted = 0
    hits_w = misses_w = 0
    for s, step in enumerate(routes):
        for layer, ids in enumerate(step):
            counts: dict[int, int] = {}
            for token in ids:
                for e in token:
                    counts[e] = counts.get(e, 0) + 1
            used = set()
            step_misses = []
            for e in sorted(counts):
                key = (layer, e)
                if key in lru:
                    lru.move_to_end(key)
                    used.add(key)
                else:
                    step_misses.append(e)
            step_misses.sort(key=lambda e: (-counts[e], e))
            limit = len(step_misses) if bound <= 0 else min(bound, len(step_misses))
            for e in step_misses[:limit]:
                oldest = next(iter(lru))
                if oldest in used:
                    break  # every row was used in this step
                del lru[oldest]
                lru[(layer, e)] = None
                used.add((layer, e))
                promoted += 1
            h, m = len(counts) - len(step_misses), len(step_misses)
            hits += h
            misses += m
            if s >= warmup:
                hits_w += h
                misses_w += m
    return {
        "hits": hits,
        "misses": misses,
        "promotions": promoted,
        "hit_rate": hits / max(hits + misses, 1),
        "hit_rate_after_warmup": hits_w / max(hits_w + misses_w, 1),
    }


def new_pool(args: argparse.Namespace, host: dict[str, Any], tokens: int) -> Any:
    """A fresh pool over ``args.layers`` layers sharing the pinned ``host``
    experts (one pinned copy for all layers and pools)."""
    import torch
    from vllm.model_executor.layers.fused_moe.expert_pool import install_expert_pool

    model = torch.nn.ModuleList(base.pending_layer(i, host, args.rows) for i in range(args.layers))
    pool = install_expert_pool(model, torch.device("cuda"), max(tokens, args.decode_tokens))
    assert pool is not None and tokens * TOP_K <= pool.max_lanes, pool
    return pool, model


def counters(pool: Any) -> tuple[int, int, int]:
    stats = pool.stats()
    return sum(stats.hits), sum(stats.misses), sum(stats.promotions)


def part_all_resident(
    args: argparse.Namespace, experts: dict[str, Any], host: dict[str, Any], tokens: int
) -> dict[str, Any]:
    """Resident baseline vs pool with all routes resident; planner cost."""
    import torch

    layers, slots = args.layers, min(args.rows, EXPERTS - 1)
    total = args.warmup + args.steps
    gen = torch.Generator().manual_seed(args.seed + tokens)
    x = (torch.randn(tokens, HIDDEN, generator=gen) / 10).to(torch.bfloat16).cuda()
    weights = torch.softmax(torch.rand(tokens, TOP_K, generator=gen), dim=1).cuda()
    ids = torch.zeros(layers, tokens, TOP_K, dtype=torch.int32, device="cuda")
    routes = resident_routes(total, layers, tokens, slots, gen).cuda()

    def feed(s: int) -> None:
        ids.copy_(routes[s])

    resident = [{k: v.clone() for k, v in experts.items()} for _ in range(layers)]

    def resident_step() -> None:
        for layer, t in enumerate(resident):
            base.resident_moe(x, t, weights, ids[layer], EXPERTS)

    feed(0)
    graph = base.capture_graph(resident_step)
    entry: dict[str, Any] = {
        "resident": base.summarize(base.time_graph(graph, feed, args.steps, args.warmup), layers)
    }
    del graph
    resident.clear()
    torch.cuda.empty_cache()

    pool, model = new_pool(args, host, tokens)

    def pool_step(pool: Any = pool) -> None:
        for layer in pool.layers:
            layer.apply(x, weights, ids[layer.index])

    graph = base.capture_graph(pool_step)
    pool.tables.set_gate(True)
    entry["pool"] = base.summarize(base.time_graph(graph, feed, args.steps, args.warmup), layers)
    h, m, p = counters(pool)
    entry["pool"].update(hits=h, misses=m, promotions=p, error_flag=int(pool.tables.error.item()))
    entry["ratio"] = entry["pool"]["median_ms"] / entry["resident"]["median_ms"]
    del graph

    # Planner + copy launch alone (no misses), as their own graph.
    plans: list[Any] = []

    def plan_copy(pool: Any = pool) -> None:
        plans[:] = [layer.plan_step(ids[layer.index]) for layer in pool.layers]
        for layer, plan in zip(pool.layers, plans, strict=True):
            layer.copy_misses(plan)

    def plan_only(pool: Any = pool) -> None:
        plans[:] = [layer.plan_step(ids[layer.index]) for layer in pool.layers]

    for name, fn in (("plan_and_copy", plan_copy), ("plan", plan_only)):
        graph = base.capture_graph(fn)
        entry[name] = base.summarize(base.time_graph(graph, feed, args.steps, args.warmup), layers)
        del graph
    entry["plan_and_copy_share_of_resident"] = (
        entry["plan_and_copy"]["median_ms"] / entry["resident"]["median_ms"]
    )
    entry["misses_total"] = counters(pool)[1]  # all-hit routes: 0
    plans.clear()
    del pool, model
    gc.collect()  # the pool and its layers refer to each other
    torch.cuda.empty_cache()
    return entry


def part_hit_rate(
    args: argparse.Namespace, host: dict[str, Any], tokens: int, bound: int
) -> dict[str, Any]:
    import torch

    layers, slots = args.layers, min(args.rows, EXPERTS - 1)
    total = args.hit_warmup + args.hit_steps
    gen = torch.Generator().manual_seed(args.seed + 1000 + tokens)
    probs = zipf_probs(layers, gen)
    routes_cpu = routes_from(probs, total, tokens, gen)
    routes = routes_cpu.cuda()
    x = (torch.randn(tokens, HIDDEN, generator=gen) / 10).to(torch.bfloat16).cuda()
    weights = torch.softmax(torch.rand(tokens, TOP_K, generator=gen), dim=1).cuda()
    ids = torch.zeros(layers, tokens, TOP_K, dtype=torch.int32, device="cuda")

    pool, model = new_pool(args, host, tokens)
    pool.tables.promote_limit.fill_(EXPERTS if bound <= 0 else bound)

    def pool_step(pool: Any = pool) -> None:
        for layer in pool.layers:
            layer.apply(x, weights, ids[layer.index])

    ids.copy_(routes[0])
    graph = base.capture_graph(pool_step)  # gate closed: placement untouched
    pool.tables.set_gate(True)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    after_warmup = (0, 0, 0)
    for s in range(total):
        if s == args.hit_warmup:
            after_warmup = counters(pool)  # a sync between steps, not timed
        ids.copy_(routes[s])
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    h, m, p = counters(pool)
    hw, mw = h - after_warmup[0], m - after_warmup[1]
    stats = pool.stats()
    sim = simulate_lru(routes_cpu.tolist(), layers, slots, bound, args.hit_warmup)
    entry = {
        "tokens": tokens,
        "bound": bound,
        "pool": {
            "hits": h,
            "misses": m,
            "promotions": p,
            "hit_rate": h / max(h + m, 1),
            "hit_rate_after_warmup": hw / max(hw + mw, 1),
            "bytes_copied": sum(stats.bytes_copied),
            "step_ms": base.summarize(times[args.hit_warmup :], layers),
            "error_flag": int(stats.error),
        },
        "simulation": sim,
    }
    entry["gap_points"] = 100 * (entry["pool"]["hit_rate"] - sim["hit_rate"])
    entry["gap_points_after_warmup"] = 100 * (
        entry["pool"]["hit_rate_after_warmup"] - sim["hit_rate_after_warmup"]
    )
    del graph, pool, model
    gc.collect()
    torch.cuda.empty_cache()
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=192, help="pool rows per layer")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    parser.add_argument("--hit-tokens", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--bounds", type=int, nargs="+", default=[8, 0], help="0: no bound")
    parser.add_argument("--decode-tokens", type=int, default=256, help="lanes are sized for this")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--hit-steps", type=int, default=60)
    parser.add_argument("--hit-warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    base._need_pool()
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    started = time.monotonic()
    data: dict[str, Any] = {
        "shape": {
            "hidden": HIDDEN,
            "intermediate": INTER,
            "experts": EXPERTS,
            "top_k": TOP_K,
            "layers": args.layers,
            "rows": args.rows,
            "decode_tokens": args.decode_tokens,
        },
        "all_resident": {},
        "hit_rate": [],
    }
    with set_current_vllm_config(VllmConfig()):
        experts = base.make_experts(EXPERTS, args.seed)
        host = {}
        for name, value in experts.items():
            host[name] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host[name].copy_(value)
        data["seconds_setup"] = round(time.monotonic() - started, 1)
        for tokens in args.tokens:
            data["all_resident"][str(tokens)] = part_all_resident(args, experts, host, tokens)
            print(
                f"all-resident {tokens}: {data['all_resident'][str(tokens)]['ratio']:.3f}x",
                flush=True,
            )
        for tokens in args.hit_tokens:
            for bound in args.bounds:
                entry = part_hit_rate(args, host, tokens, bound)
                data["hit_rate"].append(entry)
                print(
                    f"hit rate {tokens} tokens bound {bound}: pool {entry['pool']['hit_rate']:.3f} "
                    f"sim {entry['simulation']['hit_rate']:.3f}",
                    flush=True,
                )
    ok_resident = all(
        data["all_resident"][str(t)]["ratio"] <= 1.05
        for t in (1, 8, 32, 64)
        if str(t) in data["all_resident"]
    )
    ok_hits = all(
        abs(e["gap_points"]) <= 3 and abs(e["gap_points_after_warmup"]) <= 3
        for e in data["hit_rate"]
    )
    cost = data["all_resident"].get("64", {}).get("plan_and_copy_share_of_resident")
    data["goals"] = {
        "all_resident_within_1.05x_at_1_8_32_64": ok_resident,
        "hit_rate_within_3_points_of_simulation": ok_hits,
        "plan_and_copy_share_at_64_tokens": cost,
        "plan_and_copy_within_5_percent_at_64_tokens": cost is not None and cost <= 0.05,
    }
    data["seconds"] = round(time.monotonic() - started, 1)
    path = base.write_result(args.out, "pool_serving_replay", data)
    print(f"wrote {path}")
    for tokens, entry in data["all_resident"].items():
        print(
            f"{tokens:>4} tokens: resident {entry['resident']['median_ms']:.3f} ms, "
            f"pool all hits {entry['pool']['median_ms']:.3f} ms ({entry['ratio']:.3f}x), "
            f"plan+copy {entry['plan_and_copy']['median_ms']:.3f} ms "
            f"({100 * entry['plan_and_copy_share_of_resident']:.1f}%), "
            f"plan {entry['plan']['median_ms']:.3f} ms"
        )
    for entry in data["hit_rate"]:
        print(
            f"{entry['tokens']:>4} tokens, bound {entry['bound']}: hit rate pool "
            f"{entry['pool']['hit_rate']:.4f} / sim {entry['simulation']['hit_rate']:.4f} "
            f"(after warm-up {entry['pool']['hit_rate_after_warmup']:.4f} / "
            f"{entry['simulation']['hit_rate_after_warmup']:.4f}), step "
            f"{entry['pool']['step_ms']['median_ms']:.2f} ms"
        )
    print("goals:", data["goals"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
