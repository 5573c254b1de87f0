"""Kernel-time A/B of two Marlin MoE builds (stock vs fixed), plus stock vs stock noise.

Usage (from the repository root)::

    PYTHONPATH=. python scripts/marlin_ab.py --stock PATH:NS --fixed PATH:NS \\
        --out DIR [--tokens 1 8 64 4608] [--launches 100] [--rounds 15]

Problem: E=256 NVFP4 experts, top-8, hidden 4096, intermediate 1024 (the w13
GEMM: N=2048, K=4096), bf16 activations, uniform random routing, vLLM's block
size rule. For each token count and tile config, every arm captures
``--launches`` back-to-back launches in one CUDA graph; a round replays the
stock, fixed and second-stock graphs once each (order rotated per round) and
times each replay with CUDA events. Per round: fixed/stock and stock2/stock
(noise) ratios. Outputs of both builds are compared bitwise. Writes ``ab.json``
in the harness result schema (kind ``marlin_ab``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import marlin_nvfp4 as m
import torch

from harness import results as harness_results

E, TOPK, K, N = 256, 8, 4096, 2048


def configs(tokens: int, blocks_per_sm: list[int]) -> list[tuple[str, int, int, int]]:
    """Pinned tiles (the heuristic's first tile for this m-block size) plus auto.

    Pinned tiles run at ``blocks_per_sm`` (default 1, the op's default when
    tiles are pinned); auto lets the op choose tile and blocks per SM.
    """
    block = m.block_size_for(tokens, TOPK, E)
    pinned = (128, 128) if block <= 8 else (64, 256)
    out = [(f"pinned_k{pinned[0]}_n{pinned[1]}_bps{b}", *pinned, b) for b in blocks_per_sm]
    out.append(("auto", -1, -1, -1))
    if block > 8:  # the m_blocks=4 tile with the largest ptxas spill change
        out.append(("pinned_k128_n64_bps1", 128, 64, 1))
    return out


def summary(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "q1": q[0],
        "q3": q[2],
        "n": len(values),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stock", required=True, metavar="PATH:NS")
    parser.add_argument("--fixed", required=True, metavar="PATH:NS")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 4608])
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--blocks-per-sm",
        type=int,
        nargs="+",
        default=[1],
        help="blocks per SM for the pinned tiles (default 1)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    libs = {"stock": m.Lib.parse(args.stock), "fixed": m.Lib.parse(args.fixed)}
    ops = {name: lib.load() for name, lib in libs.items()}
    arms = [("stock", ops["stock"]), ("fixed", ops["fixed"]), ("stock2", ops["stock"])]

    expert = m.make_expert(ops["stock"], N, K, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    qweight = torch.randint(
        -(2**31), 2**31 - 1, (E, K // 16, 2 * N), dtype=torch.int32, device="cuda", generator=gen
    )
    scales = expert.scales.unsqueeze(0).expand(E, -1, -1).contiguous()
    gscale = torch.full((E,), expert.global_scale, dtype=torch.float32, device="cuda")

    results = []
    for tokens in args.tokens:
        cpu_gen = torch.Generator().manual_seed(tokens)
        x = (torch.randn(tokens, K, generator=cpu_gen) * 0.1).to(torch.bfloat16).cuda()
        topk = torch.rand(tokens, E, generator=cpu_gen).topk(TOPK, dim=1).indices
        block = m.block_size_for(tokens, TOPK, E)
        routing = m.route(topk, list(range(E)), block)
        weights = torch.ones((tokens, TOPK), dtype=torch.float32, device="cuda")
        for label, tk, tn, bps in configs(tokens, args.blocks_per_sm):
            graphs, outs, ws = {}, {}, {}
            for name, op in arms:
                ws[name] = m.workspace()
                outs[name] = torch.empty((tokens * TOPK, N), dtype=torch.bfloat16, device="cuda")

                def call(
                    op: Any = op,
                    out: torch.Tensor = outs[name],
                    w: torch.Tensor = ws[name],
                    x: torch.Tensor = x,
                    routing: m.Routing = routing,
                    tk: int = tk,
                    tn: int = tn,
                    weights: torch.Tensor = weights,
                    bps: int = bps,
                ) -> None:
                    m.gemm(
                        op,
                        x,
                        qweight,
                        scales,
                        gscale,
                        routing,
                        w,
                        out=out,
                        thread_k=tk,
                        thread_n=tn,
                        topk_weights=weights,
                        blocks_per_sm=bps,
                    )

                for _ in range(3):  # warm up outside the graph
                    call()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(args.launches):
                        call()
                graphs[name] = graph
            for graph in graphs.values():
                graph.replay()
            torch.cuda.synchronize()
            equal = torch.equal(outs["stock"], outs["fixed"])
            times: dict[str, list[float]] = {name: [] for name, _ in arms}
            for rnd in range(args.rounds):
                order = arms[rnd % 3 :] + arms[: rnd % 3]
                for name, _ in order:
                    start = torch.cuda.Event(enable_timing=True)
                    stop = torch.cuda.Event(enable_timing=True)
                    start.record()
                    graphs[name].replay()
                    stop.record()
                    stop.synchronize()
                    times[name].append(start.elapsed_time(stop) * 1000 / args.launches)
            ratio = [f / s for f, s in zip(times["fixed"], times["stock"], strict=True)]
            noise = [b / s for b, s in zip(times["stock2"], times["stock"], strict=True)]
            row = {
                "tokens": tokens,
                "config": label,
                "thread_k": tk,
                "thread_n": tn,
                "blocks_per_sm": bps,
                "moe_block_size": block,
                "outputs_bitwise_equal": equal,
                "us_per_launch": {n: summary(v) for n, v in times.items()},
                "fixed_over_stock": summary(ratio),
                "stock2_over_stock": summary(noise),
            }
            results.append(row)
            print(
                f"M={tokens:5} {label:22} stock {row['us_per_launch']['stock']['median']:9.2f} us"
                f"  fixed/stock {row['fixed_over_stock']['median']:.4f}"
                f" [{row['fixed_over_stock']['min']:.4f}, {row['fixed_over_stock']['max']:.4f}]"
                f"  noise {row['stock2_over_stock']['median']:.4f}"
                f" [{row['stock2_over_stock']['min']:.4f}, {row['stock2_over_stock']['max']:.4f}]"
                f"  equal={equal}",
                flush=True,
            )
            del graphs
    data = {
        "problem": {
            "experts": E,
            "top_k": TOPK,
            "size_k": K,
            "size_n": N,
            "quant": "NVFP4 weights (fe2m1f, e4m3 group-16 scales), bf16 act/out",
            "launches_per_graph": args.launches,
            "rounds": args.rounds,
            "timing": "CUDA graph of back-to-back launches, CUDA events per replay",
        },
        "results": results,
    }
    if args.out:
        harness_results.write(args.out / "ab.json", "marlin_ab", data, m.provenance(libs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
