"""Tensor-parallel (TP=2) replay of the expert pool and prefill staging (0001 + 0004).

    PYTHONPATH=.:<vllm tree> python3 scripts/pool_tp_replay.py --out DIR [--world 2]

Starts one process per GPU (NCCL for the layer all-reduces, gloo for the
host-side checks, NVLink multicast kept off). Each rank builds the layer stack
of ``scripts/staging_replay.py`` (``--layers`` synthetic NVFP4 MoE layers of the
per-rank shape, ``--experts`` experts, ``--rows`` pool rows per layer) with its
own weights, as a TP rank holds its own shard of every expert, and installs
its own pool (bank, tables, staging buffers) on its own GPU. Routes are the
same on every rank, as TP replicates the router. Then:

* tables: after decode steps with the LRU gate open, every rank's placement
  tables (residency, owners, stamps, clock) must be byte-identical;
* outputs: decode steps (lanes) and wide steps (host view and staged), each
  layer's output all-reduced over the ranks, against the same layers with
  every expert on the GPU (stock ``fused_marlin_moe`` on each rank's shard,
  all-reduced), within the tolerance of the pool's GPU tests;
* timing: steps of ``--steps`` tokens through all layers with an all-reduce
  after each layer, both ranks at once, for ``resident``, ``host_view``,
  ``staged_sync`` and ``staged``; per-rank wall times;
* host link: pinned host-to-device bandwidth and the stager's copy bandwidth
  per rank, each rank alone and both ranks at once.

Writes ``pool_tp_replay.json`` (harness result schema, kind
``pool_tp_replay``) to ``--out`` from rank 0, and prints a summary.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from pool_decode_replay import resident_moe, write_result  # same folder: sys.path[0]
from staging_replay import (
    HIDDEN,
    Replay,
    pinned_h2d_bandwidth,
    uniform_routes,
)

# NVLink multicast stays off on shared hosts (see the device notes).
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
ATOL = RTOL = 2e-2  # the pool's GPU tests use the same
MODES = ("host_view", "staged_sync", "staged")


def replay_args(args: argparse.Namespace) -> argparse.Namespace:
    """The options :class:`staging_replay.Replay` reads."""
    return argparse.Namespace(
        experts=args.experts,
        rows=args.rows,
        layers=args.layers,
        host_sets=args.host_sets,
        decode_tokens=args.decode_tokens,
        min_tokens=args.min_tokens,
        seed=args.seed,
    )


class Rank:
    """One rank's stack, and the collective steps of the replay."""

    def __init__(self, rank: int, world: int, args: argparse.Namespace, cpu: Any) -> None:
        self.rank, self.world, self.args, self.cpu = rank, world, args, cpu
        self.rp = Replay(replay_args(args), weight_seed=args.seed + 1000 * (rank + 1))
        self.layers = self.rp.pool.layers

    # -- collectives ---------------------------------------------------------

    def barrier(self) -> None:
        import torch
        import torch.distributed as dist

        torch.cuda.synchronize()
        dist.barrier(group=self.cpu)

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order, on every rank."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.cpu)
        return out

    # -- steps ---------------------------------------------------------------

    def pool_step(self, x: Any, routes: list[tuple[Any, Any]]) -> list[Any]:
        """Every pooled layer on ``x``, each output all-reduced over the ranks."""
        import torch.distributed as dist

        stager = self.rp.pool.stager
        if stager is not None:
            stager.note_step(x.shape[0])  # as vLLM's worker does per forward pass
        outs = []
        for layer, (ids, w) in zip(self.layers, routes, strict=True):
            y = layer.apply(x, w, ids)
            dist.all_reduce(y)
            outs.append(y)
        return outs

    def resident_step(
        self, x: Any, routes: list[tuple[Any, Any]], resident: list[Any]
    ) -> list[Any]:
        """The same layers with every expert on the GPU (stock Marlin), all-reduced."""
        import torch.distributed as dist

        outs = []
        for experts, (ids, w) in zip(resident, routes, strict=True):
            y = resident_moe(x, experts, w, ids, self.rp.E)
            dist.all_reduce(y)
            outs.append(y)
        return outs

    def timed(self, fn: Any, reps: int) -> list[float]:
        """Wall seconds of ``fn()`` on this rank, ranks released together."""
        import torch

        fn()
        times = []
        for _ in range(reps):
            self.barrier()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times

    # -- pieces --------------------------------------------------------------

    def tables_digest(self) -> list[bytes]:
        """Placement tables as bytes (residency, owners, stamps, clock)."""
        import torch

        t = self.rp.pool.tables
        return [
            x.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
            for x in (t.hot_table, t.owner_table, t.stamp_table, t.clock)
        ]

    def tables_identical(self) -> bool:
        digests = self.gather(self.tables_digest())
        return all(d == digests[0] for d in digests[1:])

    def compare(self, tokens: int, mode: str, resident: list[Any]) -> dict[str, Any]:
        """All-reduced pooled outputs of one step against the all-resident layers."""
        import torch

        rp = self.rp
        x = (torch.randn(tokens, HIDDEN, device="cuda", generator=rp.gen) / 10).bfloat16()
        routes = [uniform_routes(tokens, rp.E, rp.gen) for _ in self.layers]
        if mode == "decode":
            rp.set_mode("staged")
            rp.pool.tables.set_gate(True)
        else:
            rp.set_mode(mode, min_tokens=min(tokens, self.args.min_tokens))
        counted = rp.decode_counts()
        staged_before = rp.stager.stats.layers_staged
        got = self.pool_step(x, routes)
        want = self.resident_step(x, routes, resident)
        torch.cuda.synchronize()
        worst = max(
            float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))
            for a, b in zip(got, want, strict=True)
        )
        close = all(
            torch.allclose(a.float(), b.float(), atol=ATOL, rtol=RTOL)
            for a, b in zip(got, want, strict=True)
        )
        return {
            "tokens": tokens,
            "mode": mode,
            "decode_path": bool((rp.decode_counts() > counted).any()),
            "layers": len(self.layers),
            "layers_staged": rp.stager.stats.layers_staged - staged_before,
            "allclose": close,
            "bitwise_equal": all(torch.equal(a, b) for a, b in zip(got, want, strict=True)),
            "max_rel_diff": worst,
        }

    def link(self) -> dict[str, Any]:
        """Pinned H2D and stager copy bandwidth: each rank alone, then all at once."""
        nbytes = self.args.bw_bytes
        out: dict[str, Any] = {}
        for name, measure in (
            ("pinned_h2d", functools.partial(pinned_h2d_bandwidth, nbytes, 5)),
            ("stager_copy", functools.partial(self.rp.copy_bandwidth, 3)),
        ):
            alone = None
            for turn in range(self.world):
                self.barrier()
                if turn == self.rank:
                    alone = measure()["gbps_median"]
            self.barrier()
            together = measure()["gbps_median"]
            out[name] = {"alone_gbps": self.gather(alone), "together_gbps": self.gather(together)}
        return out


def run_rank(rank: int, world: int, args: argparse.Namespace, cpu: Any) -> dict[str, Any]:
    import torch

    t0 = time.monotonic()
    me = Rank(rank, world, args, cpu)
    rp = me.rp
    data: dict[str, Any] = {"build_s": time.monotonic() - t0}
    # First Marlin call JIT-compiles; keep it out of the timings.
    rp.set_mode("host_view")
    xs = (torch.randn(16, HIDDEN, device="cuda") / 10).bfloat16()
    me.pool_step(xs, [uniform_routes(16, rp.E, rp.gen) for _ in me.layers])
    me.barrier()

    residency = rp.shuffle_residency(args.shuffle_rounds)
    data["residency"] = me.gather(residency["nonresident_per_layer"])
    data["tables_identical_after_shuffle"] = me.tables_identical()

    resident = rp.resident_sets()
    checks = [me.compare(args.decode_tokens, "decode", resident)]
    checks.append({"tables_identical": me.tables_identical()})
    for tokens in args.check_steps:
        for mode in MODES:
            checks.append(me.compare(tokens, mode, resident))
    checks.append({"tables_identical": me.tables_identical()})
    data["checks"] = me.gather(checks)

    data["link"] = me.link()

    steps: dict[str, Any] = {}
    for tokens in args.steps:
        x = (torch.randn(tokens, HIDDEN, device="cuda", generator=rp.gen) / 10).bfloat16()
        routes = [uniform_routes(tokens, rp.E, rp.gen) for _ in me.layers]
        entry = {
            "resident": me.timed(
                functools.partial(me.resident_step, x, routes, resident), args.reps
            )
        }
        for mode in MODES:
            rp.set_mode(mode)
            entry[mode] = me.timed(functools.partial(me.pool_step, x, routes), args.reps)
        steps[str(tokens)] = me.gather(
            {mode: statistics.median(times) for mode, times in entry.items()}
        )
    data["steps"] = steps
    data["stager_stats"] = me.gather(vars(rp.stager.stats).copy())
    data["seconds"] = time.monotonic() - t0
    del resident
    return data


def worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(SAFE_ENV)
    import torch
    import torch.distributed as dist
    from vllm.config import VllmConfig, set_current_vllm_config

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
        device_id=torch.device("cuda", rank),
    )
    cpu = dist.new_group(backend="gloo")
    try:
        with set_current_vllm_config(VllmConfig()):
            data = run_rank(rank, world, args, cpu)
        if rank == 0:
            write(args, data)
    except Exception as exc:
        # A failed rank cannot join the others' collectives: report and leave
        # (torch.multiprocessing.spawn then stops the other ranks).
        print(f"[rank {rank}] {type(exc).__name__}: {exc}\n{traceback.format_exc()}", flush=True)
        os._exit(1)
    dist.barrier(group=cpu)
    dist.destroy_process_group()


def goals(data: dict[str, Any]) -> list[dict[str, Any]]:
    """What the run shows, as pass/fail lines."""
    checks = [c for rank in data["checks"] for c in rank if "mode" in c]
    tables = [c["tables_identical"] for rank in data["checks"] for c in rank if "mode" not in c]
    return [
        {
            "goal": "placement tables of all ranks byte-identical under identical routes",
            "pass": bool(data["tables_identical_after_shuffle"] and all(tables)),
        },
        {
            "goal": "decode and wide steps match the all-resident TP layer (all-reduced)",
            "pass": all(c["allclose"] for c in checks),
            "worst_rel_diff": max(c["max_rel_diff"] for c in checks),
        },
        {
            "goal": "decode checks ran on the lanes; staged checks staged every layer",
            "pass": all(c["decode_path"] if c["mode"] == "decode" else True for c in checks)
            and all(
                c["layers_staged"] == c["layers"] for c in checks if c["mode"].startswith("staged")
            ),
        },
    ]


def write(args: argparse.Namespace, data: dict[str, Any]) -> None:
    data["goals"] = goals(data)
    data["setup"] = {**vars(args), "out": str(args.out)}
    path = write_result(args.out, "pool_tp_replay", data, world_size=str(args.world))
    print(f"wrote {path}")
    summary(data)


def summary(data: dict[str, Any]) -> None:
    link = data["link"]
    for name in ("pinned_h2d", "stager_copy"):
        alone = ", ".join(f"{v:.1f}" for v in link[name]["alone_gbps"])
        together = ", ".join(f"{v:.1f}" for v in link[name]["together_gbps"])
        print(f"{name}: alone {alone} GB/s; together {together} GB/s (per rank)")
    ranks = len(link["pinned_h2d"]["alone_gbps"])
    print(
        f"{'tokens':>7} {'mode':>12} " + " ".join(f"{'rank ' + str(r):>10}" for r in range(ranks))
    )
    for tokens, per_rank in data["steps"].items():
        for mode in per_rank[0]:
            cells = " ".join(f"{r[mode] * 1e3:>8.1f}ms" for r in per_rank)
            print(f"{tokens:>7} {mode:>12} {cells}")
    for rank, checks in enumerate(data["checks"]):
        for c in checks:
            if "mode" in c:
                print(
                    f"rank {rank} {c['mode']:>11} {c['tokens']:>5} tokens: "
                    f"allclose {c['allclose']}, bitwise {c['bitwise_equal']}, "
                    f"max rel diff {c['max_rel_diff']:.2e}, layers staged {c['layers_staged']}"
                )
    for g in data["goals"]:
        print(f"  [{'PASS' if g['pass'] else 'FAIL'}] {g['goal']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--world", type=int, default=2, help="ranks (one GPU each)")
    parser.add_argument("--layers", type=int, default=42)
    parser.add_argument("--host-sets", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--rows", type=int, default=96, help="pool rows per layer")
    parser.add_argument("--steps", type=int, nargs="+", default=[4096, 4608, 8192])
    parser.add_argument(
        "--check-steps", type=int, nargs="+", default=[1024], help="wide steps checked"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--shuffle-rounds", type=int, default=12)
    parser.add_argument("--bw-bytes", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--timeout", type=int, default=600, help="collective timeout, seconds")
    args = parser.parse_args()
    os.environ.update(SAFE_ENV)
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < args.world:
        sys.exit(f"needs {args.world} GPUs, this host has {torch.cuda.device_count()}")
    mp.spawn(worker, args=(args.world, args, args.port), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
