"""Kernel-time A/B of two Marlin MoE builds (stock vs fixed), plus stock vs stock noise.

Usage (from the repository root)::

    PYTHONPATH=. python scripts/marlin_ab.py --stock PATH:NS --fixed PATH:NS \\
        --out DIR [--format nvfp4 gptq4] [--tokens 1 8 64 512 4608] \\
        [--rounds 15] [--target-ms 20] [--max-launches 100]

Problem: E=256 experts, top-8, hidden 4096, intermediate 1024 (the w13 GEMM:
N=2048, K=4096), uniform random routing, vLLM's block-size rule, no atomics,
fp32 reduce. Formats: ``nvfp4`` (NVFP4 weights, e4m3 group-16 scales, bf16
activations) and ``gptq4`` (GPTQ int4 weights, fp16 group-128 scales, fp16
activations). Weights are random Marlin-layout words (every bit pattern is a
valid code). For each format, token count and tile config (every tile the
generator instantiates for that m-block size, pinned at 1 block per SM, and
``auto``, the op's own choice of tile and blocks per SM) each arm captures one
CUDA graph of back-to-back launches (as many as fit in ``--target-ms``, at
most ``--max-launches``); a round replays the stock, fixed and second-stock
graphs once each (order rotated per round) and times each replay with CUDA
events. Per round: fixed/stock and stock2/stock (noise) ratios.

Outputs: the stock arm and the second stock arm write separate buffers, so
``stock_repeatable`` says whether stock reproduces itself bitwise;
``outputs_bitwise_equal`` compares fixed with stock. Writes ``ab.json`` in the
harness result schema (kind ``marlin_ab``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import marlin_nvfp4 as m
import torch

from harness import results as harness_results

E, TOPK, K, N = 256, 8, 4096, 2048
GPTQ_GROUP = 128

#: Tiles (thread_k, thread_n) the generator instantiates per m-block class.
SMALL_TILES = [(128, 128), (64, 128), (128, 64)]  # moe block 8 or 16 (m_blocks 1)
LARGE_TILES = [(64, 256), (64, 128), (128, 64)]  # moe block >= 32


def configs(block: int) -> list[tuple[str, int, int, int]]:
    """Every pinned tile of this m-block size (1 block per SM), then auto."""
    tiles = SMALL_TILES if block <= 16 else LARGE_TILES
    out = [(f"pinned_k{tk}_n{tn}", tk, tn, 1) for tk, tn in tiles]
    out.append(("auto", -1, -1, -1))
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


class Problem:
    """One format's weights, scales and launch arguments, shared by the arms."""

    def __init__(self, fmt: str, ops: Any) -> None:
        self.fmt = fmt
        gen = torch.Generator(device="cuda").manual_seed(0)
        # Marlin int4 layout is (E, K/16, 2N) int32 for both formats.
        self.qweight = torch.randint(
            -(2**31), 2**31 - 1, (E, K // 16, 2 * N), dtype=torch.int32, device="cuda",
            generator=gen,
        )  # fmt: skip
        if fmt == "nvfp4":
            expert = m.make_expert(ops, N, K, seed=0)
            self.dtype = torch.bfloat16
            self.scales = expert.scales.unsqueeze(0).expand(E, -1, -1).contiguous()
            self.gscale: torch.Tensor | None = torch.full(
                (E,), expert.global_scale, dtype=torch.float32, device="cuda"
            )
            self.b_type_id = m.NVFP4_TYPE_ID
        elif fmt == "gptq4":
            self.dtype = torch.float16
            self.scales = (
                torch.rand((E, K // GPTQ_GROUP, N), generator=gen, device="cuda") * 0.01 + 0.001
            ).to(torch.float16)
            self.gscale = None
            self.b_type_id = m.GPTQ4_TYPE_ID
        else:
            raise SystemExit(f"unknown format {fmt!r}: nvfp4 or gptq4")

    def describe(self) -> str:
        if self.fmt == "nvfp4":
            return "NVFP4 weights (fe2m1f, e4m3 group-16 scales), bf16 act/out"
        return f"GPTQ int4 weights (uint4b8, fp16 group-{GPTQ_GROUP} scales), fp16 act/out"


def run_config(
    problem: Problem,
    arms: list[tuple[str, Any]],
    x: torch.Tensor,
    routing: m.Routing,
    weights: torch.Tensor,
    tk: int,
    tn: int,
    bps: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    tokens = x.shape[0]
    outs, ws, calls = {}, {}, {}
    for name, op in arms:
        ws[name] = m.workspace()
        outs[name] = torch.empty((tokens * TOPK, N), dtype=problem.dtype, device="cuda")

        def call(op: Any = op, out: torch.Tensor = outs[name], w: torch.Tensor = ws[name]) -> None:
            m.gemm(
                op, x, problem.qweight, problem.scales, problem.gscale, routing, w, out=out,
                thread_k=tk, thread_n=tn, topk_weights=weights, blocks_per_sm=bps,
                b_type_id=problem.b_type_id,
            )  # fmt: skip

        calls[name] = call
        for _ in range(3):  # warm up outside the graph
            call()
    torch.cuda.synchronize()
    # Launches per graph from stock's eager time, the same for every arm.
    start = time.perf_counter()
    for _ in range(5):
        calls["stock"]()
    torch.cuda.synchronize()
    per_launch_ms = (time.perf_counter() - start) * 1000 / 5
    launches = max(3, min(args.max_launches, int(args.target_ms / max(per_launch_ms, 1e-3))))
    graphs = {}
    for name, _ in arms:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(launches):
                calls[name]()
        graphs[name] = graph
    for graph in graphs.values():
        graph.replay()
    torch.cuda.synchronize()
    equal = torch.equal(outs["stock"], outs["fixed"])
    repeatable = torch.equal(outs["stock"], outs["stock2"])
    times: dict[str, list[float]] = {name: [] for name, _ in arms}
    for rnd in range(args.rounds):
        order = arms[rnd % 3 :] + arms[: rnd % 3]
        for name, _ in order:
            begin = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            begin.record()
            graphs[name].replay()
            stop.record()
            stop.synchronize()
            times[name].append(begin.elapsed_time(stop) * 1000 / launches)
    ratio = [f / s for f, s in zip(times["fixed"], times["stock"], strict=True)]
    noise = [b / s for b, s in zip(times["stock2"], times["stock"], strict=True)]
    del graphs
    return {
        "launches_per_graph": launches,
        "stock_repeatable": repeatable,
        "outputs_bitwise_equal": equal,
        "us_per_launch": {n: summary(v) for n, v in times.items()},
        "fixed_over_stock": summary(ratio),
        "stock2_over_stock": summary(noise),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stock", required=True, metavar="PATH:NS")
    parser.add_argument("--fixed", required=True, metavar="PATH:NS")
    parser.add_argument("--format", nargs="+", default=["nvfp4", "gptq4"], dest="formats")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4608])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--target-ms", type=float, default=20.0, help="graph length target")
    parser.add_argument("--max-launches", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    libs = {"stock": m.Lib.parse(args.stock), "fixed": m.Lib.parse(args.fixed)}
    ops = {name: lib.load() for name, lib in libs.items()}
    arms = [("stock", ops["stock"]), ("fixed", ops["fixed"]), ("stock2", ops["stock"])]

    rows = []
    problems = {}
    for fmt in args.formats:
        problem = Problem(fmt, ops["stock"])
        problems[fmt] = problem.describe()
        for tokens in args.tokens:
            cpu_gen = torch.Generator().manual_seed(tokens)
            x = (torch.randn(tokens, K, generator=cpu_gen) * 0.1).to(problem.dtype).cuda()
            topk = torch.rand(tokens, E, generator=cpu_gen).topk(TOPK, dim=1).indices
            block = m.block_size_for(tokens, TOPK, E)
            routing = m.route(topk, list(range(E)), block)
            weights = torch.ones((tokens, TOPK), dtype=torch.float32, device="cuda")
            for label, tk, tn, bps in configs(block):
                row = {
                    "format": fmt,
                    "tokens": tokens,
                    "config": label,
                    "thread_k": tk,
                    "thread_n": tn,
                    "blocks_per_sm": bps,
                    "moe_block_size": block,
                    **run_config(problem, arms, x, routing, weights, tk, tn, bps, args),
                }
                rows.append(row)
                fos, noise = row["fixed_over_stock"], row["stock2_over_stock"]
                print(
                    f"{fmt:5} M={tokens:5} {label:16} x{row['launches_per_graph']:<3}"
                    f" stock {row['us_per_launch']['stock']['median']:9.2f} us"
                    f"  fixed/stock {fos['median']:.4f} [{fos['min']:.4f}, {fos['max']:.4f}]"
                    f"  noise {noise['median']:.4f} [{noise['min']:.4f}, {noise['max']:.4f}]"
                    f"  equal={row['outputs_bitwise_equal']}"
                    f" stock_repeatable={row['stock_repeatable']}",
                    flush=True,
                )
        del problem
        torch.cuda.empty_cache()
    data = {
        "problem": {
            "experts": E,
            "top_k": TOPK,
            "size_k": K,
            "size_n": N,
            "formats": problems,
            "rounds": args.rounds,
            "target_ms": args.target_ms,
            "max_launches": args.max_launches,
            "timing": "CUDA graph of back-to-back launches, CUDA events per replay",
        },
        "results": rows,
    }
    if args.out:
        harness_results.write(args.out / "ab.json", "marlin_ab", data, m.provenance(libs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
