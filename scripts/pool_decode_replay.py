"""Layer-level decode replay of the shared expert pool under CUDA graphs.

Builds ``--layers`` synthetic NVFP4 MoE layers of a GLM-like shape (hidden
4096, intermediate 1024 per rank, 256 experts, top-8; a 4 MiB w13 Marlin row),
installs the expert pool of the ``dev/pool`` commit over them, and times one
decode step of all layers, replayed from a CUDA graph, in four scenarios:

* ``resident``: the same layers with every expert on the GPU (stock
  ``fused_marlin_moe``), the baseline;
* ``pool_all_hits``: the pool, routes drawn only from resident experts;
* ``pool_zipf``: the pool, routes drawn from a per-layer Zipf popularity
  (``--zipf``), the "realistic" miss rate;
* ``pool_uniform``: the pool, uniformly random routes (worst case).

Each pool scenario uses a fresh pool. Eager warm-up runs with the gate closed,
then the step is captured and the gate opened, as the worker does. Step time
is measured with CUDA events around each replay. Miss rates are not read from
the device during timing: they come from the pool's device counters after
the replays.

``--breakdown`` adds, per pool scenario and batch, a second fresh pool whose
decode step is captured as three graphs over all layers - the planner
(``PoolLayer.plan_step``: on CUDA the fused Triton planner, which also writes
Marlin's alignment), the row copy (``PoolLayer.copy_misses``) and Marlin
(``PoolLayer.run_plan``: GEMM1, activation, GEMM2, moe_sum) - replayed in
that order with the same routes, each timed with CUDA events. (Runs before
the torch planner left the pool also timed that planner's prologue, as
``legacy_plan_align_remap``.) Graph launch overhead is in every part;
compare the sum of the parts with the single-graph step.

Needs torch and a vLLM import that contains
``vllm.model_executor.layers.fused_moe.expert_pool`` (e.g. the 0.33.0 bundle
with the pool commit's Python files laid over it). Usage, from the repository
root::

    PYTHONPATH=.:<vllm tree> python scripts/pool_decode_replay.py \\
        --out results/pool_decode_replay [--layers 8 --rows 64 --batch 1 4]

Writes ``pool_decode_replay.json`` (harness result schema, kind
``pool_decode_replay``) to ``--out``; with ``--breakdown`` each pool entry
also has a ``breakdown`` object (``plan``, ``copy``, ``marlin``,
``parts_sum_median_ms``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 1024, 256, 8


def _need_pool() -> None:
    try:
        import vllm.model_executor.layers.fused_moe.expert_pool  # noqa: F401
    except ImportError as exc:
        sys.exit(f"this vLLM import has no expert pool (apply the dev/pool commit): {exc}")


def make_experts(num_experts: int, seed: int) -> dict[str, Any]:
    """Random NVFP4 experts in Marlin layout on the GPU (one layer)."""
    import torch
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
        rand_marlin_weight_nvfp4_like,
    )

    torch.manual_seed(seed)
    parts: dict[str, list[Any]] = {}
    for _ in range(num_experts):
        for name, shape in (("w13", (2 * INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
            weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / 10
            _, qweight, scales, gscale = rand_marlin_weight_nvfp4_like(weight, 16)
            parts.setdefault(f"{name}_weight", []).append(qweight)
            parts.setdefault(f"{name}_weight_scale", []).append(scales)
            parts.setdefault(f"{name}_weight_scale_2", []).append(gscale)
    return {k: torch.stack(v).contiguous() for k, v in parts.items()}


def marlin_kernel(num_experts: int) -> Any:
    """The modular kernel a pooled ModelOpt NVFP4 layer builds on the Marlin
    backend (no-DP/EP prepare/finalize, the pool's ``PooledMarlinExperts``,
    which installing the pool binds to its bank). Series whose experts class
    has no ``bind`` (the 0.33.0 series) get ``MarlinExperts``, which their
    install swaps for the pool's. Its scales are never read: the pool passes
    its own tensors to Marlin."""
    import torch
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
        nvfp4_w4a16_moe_quant_config,
    )
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (
        MoEPrepareAndFinalizeNoDPEPModular,
    )

    moe = FusedMoEConfig(
        num_experts=num_experts,
        experts_per_token=TOP_K,
        hidden_dim=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=num_experts,
        num_logical_experts=num_experts,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        activation=MoEActivation.SILU,
        in_dtype=torch.bfloat16,
        device="cuda",
        routing_method=RoutingMethodType.TopK,
        max_num_tokens=512,
    )
    ones = torch.ones(num_experts)
    quant = nvfp4_w4a16_moe_quant_config(
        g1_alphas=ones, g2_alphas=ones, w1_scale=ones, w2_scale=ones
    )
    from vllm.model_executor.layers.fused_moe.expert_pool.experts import PooledMarlinExperts

    experts_cls = PooledMarlinExperts if hasattr(PooledMarlinExperts, "bind") else MarlinExperts
    return mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts_cls(moe, quant))


def pending_layer(
    index: int, experts: dict[str, Any], rows: int, num_experts: int = EXPERTS
) -> Any:
    """A module with what ``install_expert_pool`` reads from a converted
    ``RoutedExperts``: pinned Marlin-layout expert tensors plus metadata.
    (``scripts/staging_replay.py`` builds its layers with it too.)"""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    layer = torch.nn.Module()
    for key, value in experts.items():
        if value.device.type == "cpu" and value.is_pinned():
            pinned = value  # shared with other layers: the pool keeps pinned sources as they are
        else:
            pinned = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)
            pinned.copy_(value)
        layer.register_parameter(key, torch.nn.Parameter(pinned, requires_grad=False))
    attrs = {
        "layer_name": f"layers.{index}.mlp.experts",
        "local_num_experts": num_experts,
        "top_k": TOP_K,
        "expert_pool_rows": rows,
        "expert_pool": None,
        # What the guard leaves on a pooled layer: the quant method's flag on
        # this series, the layer's own flags on the 0.33.0 series.
        "expert_pool_pending": True,
        "expert_pool_layer": None,
        "activation": MoEActivation.SILU,
        "apply_router_weight_on_input": False,
        "quant_method": SimpleNamespace(
            moe_kernel=marlin_kernel(num_experts), uses_expert_pool=True
        ),
    }
    for key, value in attrs.items():
        setattr(layer, key, value)
    return layer


def make_routes(
    kind: str,
    steps: int,
    layers: int,
    batch: int,
    slots: int,
    zipf: float,
    seed: int,
) -> Any:
    """``[steps, layers, batch, TOP_K]`` int32 routes on the GPU."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(steps, layers, batch, TOP_K, dtype=torch.int32)
    if kind == "pool_zipf":
        ranks = torch.arange(1, EXPERTS + 1, dtype=torch.float64)
        popularity = ranks.pow(-zipf)
        perms = [torch.randperm(EXPERTS, generator=gen) for _ in range(layers)]
    for s in range(steps):
        for layer in range(layers):
            for b in range(batch):
                if kind == "pool_all_hits":
                    ids = torch.randperm(slots, generator=gen)[:TOP_K]
                elif kind == "pool_zipf":
                    pick = torch.multinomial(popularity, TOP_K, generator=gen)
                    ids = perms[layer][pick]
                else:
                    ids = torch.randperm(EXPERTS, generator=gen)[:TOP_K]
                out[s, layer, b] = ids.to(torch.int32)
    return out.cuda()


def reference_misses(pool: Any, routes: Any, weights: Any) -> dict[str, float]:
    """Misses of the replayed route sequence, from the pool's device counters
    (every replay ran with the gate open; the eager warm-up with it closed is
    not counted). The planner is tested step for step against the reference
    planner in tests/kernels/expert_pool/reference_planner.py."""
    stats = pool.stats()
    copies, routed = sum(stats.misses), sum(stats.hits) + sum(stats.misses)
    return {
        "misses": copies,
        "distinct_routed": routed,
        "miss_rate": copies / max(routed, 1),
        "misses_per_layer_step": copies / (routes.shape[0] * routes.shape[1]),
    }


ROOT = Path(__file__).resolve().parent.parent


def write_result(out: Path, kind: str, data: dict[str, Any], **extra: str) -> Path:
    """Write ``out/<kind>.json`` in the harness result schema, with the vLLM
    import and the GPU in its provenance (the replay scripts share it)."""
    import torch
    import vllm

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from harness import results as harness_results

    prov = harness_results.provenance(
        [Path(sys.executable).name, *sys.argv],
        vllm_version=str(vllm.__version__),
        vllm_path=str(Path(vllm.__file__).parent),
        gpu_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        **extra,
    )
    return harness_results.write(out / f"{kind}.json", kind, data, prov)


def capture_graph(step_fn: Any) -> Any:
    """A CUDA graph of ``step_fn``, after one eager warm-up on the capture stream
    (Triton compiles its kernels there). ``scripts/staging_replay.py`` uses it too."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step_fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step_fn()
    return graph


def resident_moe(x: Any, experts: dict[str, Any], weights: Any, ids: Any, num_experts: int) -> Any:
    """Stock ``fused_marlin_moe`` over one layer whose experts are all on the GPU
    (the all-resident baseline; ``scripts/staging_replay.py`` uses it too)."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.scalar_type import scalar_types

    return fused_marlin_moe(
        x,
        experts["w13_weight"],
        experts["w2_weight"],
        None,
        None,
        experts["w13_weight_scale"],
        experts["w2_weight_scale"],
        weights,
        ids,
        quant_type_id=scalar_types.float4_e2m1f.id,
        global_num_experts=num_experts,
        global_scale1=experts["w13_weight_scale_2"],
        global_scale2=experts["w2_weight_scale_2"],
    )


def time_graph(graph: Any, feed: Any, steps: int, warmup: int) -> list[float]:
    """Milliseconds per replay for ``steps`` steps after ``warmup`` steps."""
    import torch

    times = []
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    for s in range(warmup + steps):
        feed(s)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if s >= warmup:
            times.append(start.elapsed_time(end))
    return times


def summarize(times: list[float], layers: int) -> dict[str, Any]:
    ordered = sorted(times)
    return {
        "steps": len(times),
        "median_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
        "p10_ms": ordered[len(ordered) // 10],
        "p90_ms": ordered[(len(ordered) * 9) // 10],
        "median_us_per_layer": 1000 * statistics.median(times) / layers,
    }


def breakdown_case(
    args: argparse.Namespace,
    routes: Any,
    x: Any,
    weights: Any,
    static_ids: Any,
    experts: dict[str, Any],
) -> dict[str, Any]:
    """Time planner, copy and Marlin of the pool's decode step separately."""
    import torch
    from vllm.model_executor.layers.fused_moe.expert_pool import install_expert_pool

    layers = args.layers
    model = torch.nn.ModuleList(pending_layer(i, experts, args.rows) for i in range(layers))
    pool = install_expert_pool(model, torch.device("cuda"), args.decode_tokens)
    assert pool is not None
    t = pool.tables
    plans: list[Any] = []

    def plan_all() -> None:
        plans[:] = [layer.plan_step(static_ids[layer.index]) for layer in pool.layers]

    def copy_all() -> None:
        for layer, plan in zip(pool.layers, plans, strict=True):
            layer.copy_misses(plan)

    def marlin_all() -> None:
        for layer, plan in zip(pool.layers, plans, strict=True):
            layer.run_plan(x, weights, plan)

    static_ids.copy_(routes[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = {}
    with torch.cuda.stream(stream):
        for fn in (plan_all, copy_all, marlin_all):
            fn()  # eager warm-up, gates closed
    torch.cuda.current_stream().wait_stream(stream)
    for name, fn in (
        ("plan", plan_all),
        ("copy", copy_all),
        ("marlin", marlin_all),
    ):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
        graphs[name] = graph
    t.set_gate(True)

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for s in range(args.warmup + args.steps):
        static_ids.copy_(routes[s])
        for name, graph in graphs.items():
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if s >= args.warmup:
                times[name].append(start.elapsed_time(end))
    out: dict[str, Any] = {name: summarize(v, layers) for name, v in times.items()}
    out["parts_sum_median_ms"] = sum(out[name]["median_ms"] for name in ("plan", "copy", "marlin"))
    out["error_flag"] = int(t.error.item())
    graphs.clear()
    plans.clear()
    return out


def run_case(args: argparse.Namespace, batch: int, experts: dict[str, Any]) -> Any:
    import torch
    from vllm.model_executor.layers.fused_moe.expert_pool import install_expert_pool

    layers = args.layers
    total = args.warmup + args.steps
    gen = torch.Generator().manual_seed(args.seed + batch)
    x = (torch.randn(batch, HIDDEN, generator=gen) / 10).to(torch.bfloat16).cuda()
    weights = torch.softmax(torch.rand(batch, TOP_K, generator=gen), dim=1).cuda()
    static_ids = torch.zeros(layers, batch, TOP_K, dtype=torch.int32, device="cuda")
    slots = min(args.rows, EXPERTS - 1)
    results: dict[str, Any] = {}

    # Baseline: every expert resident, one device copy per layer.
    resident = [{k: v.clone() for k, v in experts.items()} for _ in range(layers)]

    def resident_step() -> None:
        for layer, t in enumerate(resident):
            resident_moe(x, t, weights, static_ids[layer], EXPERTS)

    uniform = make_routes("pool_uniform", total, layers, batch, slots, 0, args.seed)
    graph = capture_graph(resident_step)
    times = time_graph(graph, lambda s: static_ids.copy_(uniform[s]), args.steps, args.warmup)
    results["resident"] = summarize(times, layers)
    resident.clear()
    del graph
    torch.cuda.empty_cache()

    for kind in ("pool_all_hits", "pool_zipf", "pool_uniform"):
        routes = make_routes(kind, total, layers, batch, slots, args.zipf, args.seed)
        model = torch.nn.ModuleList(pending_layer(i, experts, args.rows) for i in range(layers))
        pool = install_expert_pool(model, torch.device("cuda"), args.decode_tokens)
        assert pool is not None
        if batch * TOP_K > pool.max_lanes:
            raise SystemExit(
                f"batch {batch} x top_k {TOP_K} exceeds the {pool.max_lanes} "
                "decode lanes (raise --decode-tokens)"
            )

        def pool_step(pool: Any = pool) -> None:
            for layer in pool.layers:
                layer.apply(x, weights, static_ids[layer.index])

        static_ids.copy_(routes[0])
        graph = capture_graph(pool_step)
        pool.tables.set_gate(True)
        times = time_graph(
            graph, lambda s, r=routes: static_ids.copy_(r[s]), args.steps, args.warmup
        )
        entry = summarize(times, layers)
        entry.update(reference_misses(pool, routes, weights))
        entry["error_flag"] = int(pool.tables.error.item())
        entry["bank_gib"] = pool.geometry.total_bytes / (1 << 30)
        entry["row_bytes"] = {
            name: pool.geometry.row_bytes(name) for name in pool.geometry.row_shapes
        }
        results[kind] = entry
        del graph, pool, model
        torch.cuda.empty_cache()
        if args.breakdown:
            entry["breakdown"] = breakdown_case(args, routes, x, weights, static_ids, experts)
            torch.cuda.empty_cache()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64, help="pool rows per layer")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time planner, copy and Marlin as separate graphs",
    )
    args = parser.parse_args()

    _need_pool()
    if args.breakdown:
        from vllm.model_executor.layers.fused_moe.expert_pool.pool_layer import PoolLayer

        if not hasattr(PoolLayer, "plan_step"):
            sys.exit("--breakdown needs the pool with PoolLayer.plan_step (fused planner)")
    from vllm.config import VllmConfig, set_current_vllm_config

    started = time.monotonic()
    with set_current_vllm_config(VllmConfig()):
        experts = make_experts(EXPERTS, args.seed)
        cases = {str(batch): run_case(args, batch, experts) for batch in args.batch}
    data = {
        "shape": {
            "hidden": HIDDEN,
            "intermediate": INTER,
            "experts": EXPERTS,
            "top_k": TOP_K,
            "layers": args.layers,
            "rows": args.rows,
            "decode_tokens": args.decode_tokens,
            "zipf": args.zipf,
            "breakdown": args.breakdown,
        },
        "cases": cases,
        "seconds": round(time.monotonic() - started, 1),
    }
    path = write_result(args.out, "pool_decode_replay", data)
    print(f"wrote {path}")
    for batch, case in cases.items():
        for kind, entry in case.items():
            print(
                f"batch {batch:>3} {kind:14} median {entry['median_ms']:.3f} ms"
                + (f"  miss rate {entry['miss_rate']:.3f}" if "miss_rate" in entry else "")
            )
            parts = entry.get("breakdown")
            if parts:
                print(
                    "    breakdown: "
                    + "  ".join(
                        f"{name} {parts[name]['median_ms']:.3f}"
                        for name in ("plan", "copy", "marlin")
                    )
                    + f"  (parts sum {parts['parts_sum_median_ms']:.3f} ms)"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
