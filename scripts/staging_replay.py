"""Layer-level replay of expert-pool prefill staging (series commit 0004).

Builds a stack of ``--layers`` synthetic NVFP4 MoE layers of a GLM-like
per-rank shape (hidden 4096, intermediate 1024 per partition, ``--experts``
experts, top-8) in pinned host memory, installs the expert pool of series
commit 0001 with the prefill stager of 0004 over them (``--rows`` pool rows
per layer), shuffles residency with decode steps under the global LRU, and
then measures, with the real Marlin kernel:

* per-step time of the MoE stack (wall clock, host sync included) for steps
  of ``--steps`` tokens (default 4096, 4608, 8192), uniformly routed, in four
  modes: ``resident`` (every expert on the GPU, stock ``fused_marlin_moe``),
  ``host_view`` (partition path reading non-resident experts through UVA),
  ``staged_sync`` (staging without next-layer prefetch: each layer's copy
  starts after the work queued before it) and ``staged`` (staging with
  prefetch);
* bytes over PCIe per step: staged bytes exactly (stager counters), host-view
  bytes from a model (one read of an expert per Marlin M-block) and, where
  NVML is available, integrated from NVML PCIe RX throughput samples
  (approximate: the counter is a KB/s rate over a ~20 ms window);
* the pinned host-to-device copy bandwidth of this machine in the same run,
  and the stager's own copy bandwidth (its copies alone, no compute);
* MoE-only TTFT estimates for 12.5K and 81.6K-token prompts from per-step
  times (chunks of the step size, remainder steps measured too);
* decode step time (``--decode-tokens`` tokens) with staging attached and
  detached, interleaved: replayed from CUDA graphs (what the goal uses: the
  seed decoded under FULL_DECODE_ONLY) and, for reference, eager.

It then checks the issue's goals and records pass/fail for each:

1. staged step <= 1.15 x max(all-resident compute, non-resident bytes /
   measured pinned H2D bandwidth), at every step size;
2. host view / staged >= 4x at 4608 tokens;
3. staging copy bandwidth >= 90% of the measured pinned H2D bandwidth;
4. decode with staging on within 2% of off.

The seed's numbers are end-to-end TTFT of a whole model (GLM-5.3-Flash NVFP4,
TP=2, RTX PRO 6000, PCIe); ours cover only the routed experts of an
``--layers``-layer stack on one H200, so only ratios are compared.

Layers: 42 by default, the seed model's pooled MoE layers as inferred in
SERIES.md; the first layer's copy cannot overlap anything within a step, so
the layer count sets how much of the step it is. The layers share
``--host-sets`` distinct pinned expert sets round robin, which keeps host
memory bounded; timing depends on the bytes moved and computed, not on which
bytes they are.

Memory (defaults: 42 layers x 256 experts, 6.75 MiB per expert, 8 host sets):
13.5 GiB of pinned host memory; on the GPU a 53 GiB bank (192 rows per layer),
3.4 GiB of staging buffers and 13.5 GiB for the all-resident baseline.

Needs torch and a vLLM import containing the expert pool and
``expert_pool/stage.py`` (the 0.33.0 bundle with the series' Python files laid
over it). From the repository root::

    PYTHONPATH=.:<vllm tree> python scripts/staging_replay.py \\
        --out results/staging_replay [--quick]

Writes ``staging_replay.json`` (harness result schema, kind
``staging_replay``) to ``--out`` and prints a short table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from pool_decode_replay import (  # same folder: sys.path[0]
    capture_graph,
    pending_layer,
    resident_moe,
    write_result,
)

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


def _need_stage() -> None:
    try:
        import vllm.model_executor.layers.fused_moe.expert_pool.stage  # noqa: F401
    except ImportError as exc:
        sys.exit(f"this vLLM import has no prefill staging (apply dev/staging): {exc}")


# ---------------------------------------------------------------------------
# Synthetic experts and pool


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


def pinned_h2d_bandwidth(nbytes: int, reps: int) -> dict[str, Any]:
    """Pinned host -> device copy bandwidth (GB/s, 1e9 B/s) with CUDA events."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rates = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    del src, dst
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


def timed(fn: Any, reps: int, sampler: PcieSampler | None = None) -> dict[str, Any]:
    """Wall-clock seconds of ``fn()`` (synchronized), one warm-up call first."""
    import torch

    fn()
    torch.cuda.synchronize()
    times: list[float] = []
    pcie: list[float] = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if sampler is not None and sampler.available:
            with sampler:
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            if sampler.bytes is not None:
                pcie.append(sampler.bytes)
        else:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "reps": reps,
        "nvml_rx_bytes_median": statistics.median(pcie) if pcie else None,
    }


def chunks(prompt: int, step: int) -> list[int]:
    """Prefill chunk sizes of a prompt at a given step size."""
    out = [step] * (prompt // step)
    if prompt % step:
        out.append(prompt % step)
    return out


# ---------------------------------------------------------------------------
# The replay


class Replay:
    """The pooled layer stack of a replay and the measurements on it.

    ``args`` are this script's options; ``weight_seed`` (default
    ``args.seed``) seeds the expert weights apart from the routes, so ranks
    of a tensor-parallel replay (``scripts/pool_tp_replay.py``) hold
    different shards under the same routes.
    """

    def __init__(self, args: argparse.Namespace, weight_seed: int | None = None) -> None:
        import torch
        from vllm.model_executor.layers.fused_moe.expert_pool import install_expert_pool
        from vllm.model_executor.layers.fused_moe.expert_pool.stage import STAGER_KEY

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
        self.stager = self.pool.extras.get(STAGER_KEY)
        if self.stager is None:
            raise SystemExit("no prefill stager attached (is staging disabled in the config?)")
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

    # -- modes ---------------------------------------------------------------

    def set_mode(self, mode: str, min_tokens: int | None = None) -> None:
        self.attach(mode != "host_view")
        self.stager.prefetch = mode == "staged"
        self.stager.min_tokens = self.args.min_tokens if min_tokens is None else min_tokens

    def pool_step(self, x: Any, routes: list[tuple[Any, Any]]) -> list[Any]:
        return [
            layer.apply(x, w, ids) for layer, (ids, w) in zip(self.pool.layers, routes, strict=True)
        ]

    def resident_step(self, x: Any, routes: list[tuple[Any, Any]], resident: list[Any]) -> None:
        for t, (ids, w) in zip(resident, routes, strict=True):
            resident_moe(x, t, w, ids, self.E)

    # -- pieces --------------------------------------------------------------

    def shuffle_residency(self, rounds: int) -> dict[str, Any]:
        """Decode steps with the gate open: the global LRU moves rows between layers."""
        import torch

        self.pool.tables.set_gate(True)
        tokens = self.args.decode_tokens
        x = (torch.randn(tokens, HIDDEN, device="cuda", generator=self.gen) / 10).bfloat16()
        for _ in range(rounds):
            for layer in self.pool.layers:
                ids, w = uniform_routes(tokens, self.E, self.gen)
                layer.apply(x, w, ids)
        torch.cuda.synchronize()
        return self.residency()

    def residency(self) -> dict[str, Any]:
        from vllm.model_executor.layers.fused_moe.expert_pool.stage import nonresident_runs

        hot = self.pool.tables.hot_table.cpu().view(self.pool.tables.num_layers, self.E)
        runs = nonresident_runs(hot)
        nonres = [(hot[i] < 0).sum().item() for i in range(hot.shape[0])]
        per_expert = sum(self.row_bytes.values())
        return {
            "nonresident_per_layer": nonres,
            "runs_per_layer": [len(r) for r in runs],
            "nonresident_bytes_per_step": sum(nonres) * per_expert,
        }

    def hostview_bytes_model(self, routes: list[tuple[Any, Any]], tokens: int) -> int:
        """Host-view bytes if Marlin reads each non-resident expert once per M-block."""
        import torch
        from vllm.model_executor.layers.fused_moe.expert_pool.layer import marlin_block_size

        bm = marlin_block_size(tokens, TOP_K, self.E, None)
        per_expert = sum(self.row_bytes.values())
        total = 0
        for layer, (ids, _) in zip(self.pool.layers, routes, strict=True):
            counts = torch.bincount(ids.reshape(-1).long(), minlength=self.E)
            hot = self.pool.tables.hot_slice(layer.index)
            blocks = torch.where(hot < 0, (counts + bm - 1) // bm, torch.zeros_like(counts))
            total += int(blocks.sum().item()) * per_expert
        return total

    def copy_bandwidth(self, reps: int) -> dict[str, Any]:
        """The stager's copies alone: every layer's runs, back to back, no compute."""
        import torch

        st = self.stager
        rates = []
        moved = copies = 0
        for _ in range(reps):
            torch.cuda.synchronize()
            st.plan_step()
            before, calls = st.stats.bytes_copied, st.stats.copies
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(st.stream)
            for i in range(len(self.pool.layers)):
                st.issue_copy(i % st.num_buffers, i)
            end.record(st.stream)
            end.synchronize()
            moved = st.stats.bytes_copied - before
            copies = st.stats.copies - calls
            rates.append(moved / (start.elapsed_time(end) / 1e3) / 1e9)
        # Invalidate the plan so a later step re-plans (and re-copies).
        st.runs = None
        return {
            "gbps_median": statistics.median(rates),
            "gbps_max": max(rates),
            "bytes_per_pass": moved,
            "copies_per_pass": copies,
        }

    def correctness(self, tokens: int) -> dict[str, Any]:
        """Staged output vs host-view output of every layer (same inputs)."""
        import torch

        x = (torch.randn(tokens, HIDDEN, device="cuda", generator=self.gen) / 10).bfloat16()
        routes = [uniform_routes(tokens, self.E, self.gen) for _ in self.pool.layers]
        self.set_mode("host_view")
        ref_a = self.pool_step(x, routes)
        ref_b = self.pool_step(x, routes)
        # Staging at small M, where Marlin is bitwise repeatable.
        self.set_mode("staged", min_tokens=tokens)
        staged_before = self.stager.stats.layers_staged
        staged = self.pool_step(x, routes)
        torch.cuda.synchronize()
        layers_staged = self.stager.stats.layers_staged - staged_before
        self.set_mode("staged")
        max_diff = max(
            float((a.float() - b.float()).abs().max()) for a, b in zip(staged, ref_a, strict=True)
        )
        return {
            "tokens": tokens,
            "layers_staged": layers_staged,
            "reference_repeatable": all(
                torch.equal(a, b) for a, b in zip(ref_a, ref_b, strict=True)
            ),
            "bitwise_equal": all(torch.equal(a, b) for a, b in zip(staged, ref_a, strict=True)),
            "max_abs_diff": max_diff,
            "finite": all(bool(torch.isfinite(a).all()) for a in staged),
        }

    def resident_routes(self, tokens: int) -> list[tuple[Any, Any]]:
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

    def decode(self, iters: int, replays: int) -> dict[str, Any]:
        """Decode steps of the stack with staging on (attached) and off (detached).

        For two kinds of routes - ``uniform`` (the global LRU copies every miss
        into the bank, so copies dominate) and ``all_hits`` (routes among
        resident experts only, so the step is the Marlin passes and the
        planner) - two measurements, on and off interleaved in both:
        ``graphs`` replays the decode step of all layers from CUDA graphs
        captured once with the stager attached and once without (vLLM decodes
        in graphs under FULL_DECODE_ONLY, the seed's setup); each sample is
        ``replays`` back-to-back replays timed with CUDA events, fed routes
        from a cycle of :data:`FEED_ROUTES` sets that both modes share.
        ``eager`` times single uncaptured steps by wall clock (host launch
        overhead included, so it is noisier), each with fresh routes, so
        neither mode runs on rows the other just brought in.
        """
        import torch

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
        for kind, make in kinds.items():
            eager: dict[str, list[float]] = {"on": [], "off": []}
            for it in range(iters):
                for mode in order if it % 2 == 0 else order[::-1]:
                    routes = make()
                    self.attach(mode == "on")
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    self.pool_step(x, routes)
                    torch.cuda.synchronize()
                    eager[mode].append(time.perf_counter() - t0)

            feed = [make() for _ in range(FEED_ROUTES)]
            static = [(ids.clone(), w.clone()) for ids, w in feed[0]]
            graphs = {}
            for mode in order:
                self.attach(mode == "on")
                graphs[mode] = capture_graph(functools.partial(self.pool_step, x, static))
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            replayed: dict[str, list[float]] = {"on": [], "off": []}
            step = 0
            for sample in range(iters):
                for mode in order if sample % 2 == 0 else order[::-1]:
                    start.record()
                    for _ in range(replays):
                        for (ids, w), (new_ids, new_w) in zip(
                            static, feed[step % FEED_ROUTES], strict=True
                        ):
                            ids.copy_(new_ids)
                            w.copy_(new_w)
                        graphs[mode].replay()
                        step += 1
                    end.record()
                    end.synchronize()
                    replayed[mode].append(start.elapsed_time(end) / 1e3 / replays)
            graphs.clear()
            out[kind] = {"graphs": medians(replayed), "eager": medians(eager)}
        self.attach(True)
        # The goal: graph replays, both kinds of routes; the larger deviation counts.
        ratios = [out[kind]["graphs"]["on_over_off"] for kind in kinds]
        out["on_over_off"] = max(ratios, key=lambda r: abs(r - 1))
        out["decode_calls_checked"] = all(layer.decode_calls > 0 for layer in self.pool.layers)
        return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    data: dict[str, Any] = {"errors": []}
    started = time.monotonic()
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
        "staging_buffers": rp.stager.num_buffers,
        "staging_buffer_gib": rp.stager.buffer_bytes / GIB,
        "min_tokens": args.min_tokens,
        "build_s": rp.build_s,
    }

    # First Marlin call JIT-compiles (no sm_90 SASS in the wheel).
    t0 = time.monotonic()
    rp.set_mode("host_view")
    xs = (torch.randn(16, HIDDEN, device="cuda") / 10).bfloat16()
    rp.pool_step(xs, [uniform_routes(16, args.experts, rp.gen) for _ in rp.pool.layers])
    torch.cuda.synchronize()
    data["first_call_s"] = time.monotonic() - t0

    data["residency"] = rp.shuffle_residency(args.shuffle_rounds)
    nonres_bytes = data["residency"]["nonresident_bytes_per_step"]
    data["copy_bound_s"] = nonres_bytes / (h2d * 1e9)
    data["stager_copy"] = rp.copy_bandwidth(3)
    data["correctness"] = rp.correctness(args.check_tokens)

    sampler = PcieSampler()
    data["nvml"] = {"available": sampler.available, "error": sampler.error}

    sizes = sorted(
        set(args.steps)
        | {r for s in args.steps for p in PROMPTS.values() if (r := p % s) and args.remainders}
    )
    steps: dict[str, Any] = {}
    resident = None
    for tokens in sizes:
        x = (torch.randn(tokens, HIDDEN, device="cuda", generator=rp.gen) / 10).bfloat16()
        routes = [uniform_routes(tokens, args.experts, rp.gen) for _ in rp.pool.layers]
        entry: dict[str, Any] = {"tokens": tokens, "main": tokens in args.steps}
        if tokens in args.steps:
            if resident is None:
                resident = rp.resident_sets()
            entry["resident"] = timed(
                functools.partial(rp.resident_step, x, routes, resident), args.reps
            )
        for mode in ("host_view", "staged_sync", "staged"):
            rp.set_mode(mode)
            before = rp.stager.stats.bytes_copied
            staged_before = rp.stager.stats.layers_staged
            entry[mode] = timed(functools.partial(rp.pool_step, x, routes), args.reps, sampler)
            calls = args.reps + 1
            entry[mode]["staged_layers_per_step"] = (
                rp.stager.stats.layers_staged - staged_before
            ) / calls
            entry[mode]["copied_bytes_per_step"] = (rp.stager.stats.bytes_copied - before) / calls
        entry["host_view"]["model_bytes_per_step"] = rp.hostview_bytes_model(routes, tokens)
        steps[str(tokens)] = entry
    del resident
    torch.cuda.empty_cache()
    data["steps"] = steps
    data["stager_stats"] = vars(rp.stager.stats).copy()

    # TTFT (MoE stack only) from per-step times.
    def step_s(mode: str, tokens: int) -> float | None:
        e = steps.get(str(tokens))
        if e is None:
            return None
        return float(e[mode]["median_s"])

    ttft: dict[str, Any] = {}
    for s in args.steps:
        for mode in ("host_view", "staged_sync", "staged"):
            for label, prompt in PROMPTS.items():
                parts = [step_s(mode, c) for c in chunks(prompt, s)]
                estimated = False
                if any(p is None for p in parts):
                    # Remainder not measured (--no-remainders): scale the full step linearly.
                    full = step_s(mode, s)
                    assert full is not None
                    parts = [
                        p if p is not None else full * c / s
                        for p, c in zip(parts, chunks(prompt, s), strict=True)
                    ]
                    estimated = True
                ttft[f"{mode}_{s}_{label}"] = {
                    "seconds": sum(p for p in parts if p is not None),
                    "steps": len(parts),
                    "remainder_estimated": estimated,
                }
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

    data["decode"] = rp.decode(args.decode_iters, args.decode_replays)

    # Goals.
    goals = []
    g1 = []
    for s in args.steps:
        e = steps[str(s)]
        bound = max(e["resident"]["median_s"], data["copy_bound_s"])
        g1.append(
            {
                "tokens": s,
                "staged_s": e["staged"]["median_s"],
                "resident_s": e["resident"]["median_s"],
                "copy_bound_s": data["copy_bound_s"],
                "limit_s": 1.15 * bound,
                "pass": e["staged"]["median_s"] <= 1.15 * bound,
            }
        )
    goals.append(
        {
            "goal": "staged step <= 1.15 x max(all-resident compute, non-resident bytes / H2D bw)",
            "detail": g1,
            "pass": all(g["pass"] for g in g1),
        }
    )
    if "4608" in steps:
        e = steps["4608"]
        r = e["host_view"]["median_s"] / e["staged"]["median_s"]
        goals.append(
            {"goal": "host view / staged >= 4x at 4608 tokens", "value": r, "pass": r >= 4}
        )
    else:
        goals.append(
            {"goal": "host view / staged >= 4x at 4608 tokens", "value": None, "pass": None}
        )
    copy_frac = data["stager_copy"]["gbps_median"] / h2d
    goals.append(
        {
            "goal": "staging copy bandwidth >= 90% of measured pinned H2D bandwidth",
            "value": copy_frac,
            "pass": copy_frac >= 0.9,
        }
    )
    dec = data["decode"]["on_over_off"]
    goals.append(
        {
            "goal": "decode with staging on within 2% of off",
            "value": dec,
            "pass": abs(dec - 1) <= 0.02,
        }
    )
    data["goals"] = goals
    check = data["correctness"]
    data["correctness_ok"] = (
        check["finite"]
        and check["layers_staged"] == args.layers
        and (check["bitwise_equal"] or not check["reference_repeatable"])
    )
    data["seconds"] = time.monotonic() - started
    return data


def print_table(data: dict[str, Any]) -> None:
    print(
        f"pinned H2D {data['pinned_h2d']['gbps_median']:.1f} GB/s; "
        f"stager copies {data['stager_copy']['gbps_median']:.1f} GB/s; "
        f"non-resident {data['residency']['nonresident_bytes_per_step'] / GIB:.2f} GiB/step"
    )
    print(
        f"{'tokens':>7} {'resident':>9} {'host':>9} {'sync':>9} {'staged':>9} "
        f"{'host/stg':>8} {'staged GiB':>10} {'host GiB*':>9} {'nvml host GiB':>13}"
    )
    for key, e in data["steps"].items():
        res = e.get("resident", {}).get("median_s")
        host, sync, stg = (e[m]["median_s"] for m in ("host_view", "staged_sync", "staged"))
        nv = e["host_view"]["nvml_rx_bytes_median"]
        print(
            f"{key:>7} {res * 1e3 if res else float('nan'):>8.1f}ms {host * 1e3:>7.1f}ms "
            f"{sync * 1e3:>7.1f}ms {stg * 1e3:>7.1f}ms {host / stg:>8.2f} "
            f"{e['staged']['copied_bytes_per_step'] / GIB:>10.2f} "
            f"{e['host_view']['model_bytes_per_step'] / GIB:>9.2f} "
            f"{(nv / GIB) if nv is not None else float('nan'):>13.2f}"
        )
    print("(* host GiB: model, one read per Marlin M-block)")
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
    for g in data["goals"]:
        value = g.get("value")
        shown = f" ({value:.3f})" if isinstance(value, float) else ""
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[g["pass"]]
        print(f"  [{verdict}] {g['goal']}{shown}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="4 layers, 4608 only, fewer reps")
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
    parser.add_argument("--steps", type=int, nargs="+", default=[4096, 4608, 8192])
    parser.add_argument("--no-remainders", dest="remainders", action="store_false")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--decode-iters", type=int, default=50, help="decode samples per mode")
    parser.add_argument("--decode-replays", type=int, default=5, help="graph replays per sample")
    parser.add_argument("--shuffle-rounds", type=int, default=12)
    parser.add_argument("--check-tokens", type=int, default=32)
    parser.add_argument("--bw-bytes", type=int, default=1 << 30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.layers = min(args.layers, 4)
        args.steps = [4608]
        args.reps = 2
        args.decode_iters = 60
        args.shuffle_rounds = 6
        args.bw_bytes = 512 << 20
    _need_stage()
    from vllm.config import VllmConfig, set_current_vllm_config

    data: dict[str, Any]
    with set_current_vllm_config(VllmConfig()):
        try:
            data = run(args)
        except Exception as exc:
            data = {"failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    path = write_result(args.out, "staging_replay", data)
    print(f"wrote {path}")
    if "failed" in data:
        print(data["traceback"])
        return 1
    print_table(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
