"""Would copying only a step's routed non-resident experts beat the host view?

    PYTHONPATH=$PWD python3 scripts/routed_copy_probe.py --out DIR --experts 256 --rows 192

Issue #18 asks, for mid-size steps, for a copy of only the routed non-resident
experts. Without a host sync only the device knows a step's routes, so such a
copy has to run on the SMs through the host view (the pool's ``copy_pool_rows``
kernel, as the stager's fix-up does), after the layer's router and before its
Marlin pass. This probe measures that design before anything is built into the
series: on the layer stack of ``scripts/staging_replay.py`` (same shape, uniform
routes) it times whole steps of each ``--sizes`` width in three ways, one after
the other on the same inputs:

* ``host_view``: no stager; Marlin reads the non-resident experts through the
  host view (what 0004 does below its cost model's threshold);
* ``routed``: a stand-in stager (:class:`RoutedOnly`) that, per layer, marks the
  routed non-resident experts on the device, copies exactly those rows through
  the host view into a device buffer with ``copy_pool_rows`` on the compute
  stream, and hands the buffer to Marlin (the prototype of the deliverable);
* ``staged``: 0004's stager forced on at this width (every non-resident row by
  DMA, layer ``i + 1`` copied while layer ``i`` computes).

Every mode runs the worker's per-step hook (``note_step``) before its layers.
It also records the pinned H2D rate, the copy kernel's rate through the host
view (``Replay.uva_copy_bandwidth``), the routed non-resident bytes of each
step, whether the host view repeats itself bitwise and whether the routed and
staged outputs equal it (with each one's largest difference), and what the
series does at each width (the cost model's choice). Writes
``routed_copy_probe.json`` (harness result schema) to ``--out``, with the
widths measured before any failure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from pool_decode_replay import write_result  # same folder: sys.path[0]
from staging_replay import (
    Replay,
    _need_stage,
    event_times_ms,
    parse_args,
    pinned_h2d_bandwidth,
    replay_vllm_config,
)

DEFAULT_SIZES = (16, 24, 32, 48, 64, 96, 128, 256)
MODES = ("host_view", "routed", "staged")


def routed_nonresident(tables: Any, layer_index: int, ids: Any) -> Any:
    """``[E]`` bool on the device: experts the step routes to that the bank lacks."""
    import torch

    routed = torch.zeros(tables.num_experts, dtype=torch.bool, device=ids.device)
    routed[ids.reshape(-1).long()] = True
    return (tables.hot_slice(layer_index) < 0) & routed


class RoutedOnly:
    """A stand-in stager: the routed non-resident rows of each layer, copied by
    the SMs through the host view into one device buffer (E rows, by expert id).

    ``routes`` maps a layer's index to the ``[T, K]`` expert ids of the step
    about to run; the layers run one after another on the compute stream, so
    one buffer serves all of them.
    """

    def __init__(self, replay: Replay) -> None:
        import torch
        from vllm.model_executor.layers.fused_moe.expert_pool.bank import (
            POOL_TENSORS,
            word_view,
        )

        stager = replay.stager
        self.tables = replay.pool.tables
        self.buffer = {name: torch.empty_like(t) for name, t in stager.buffers[0].items()}
        self.words = [word_view(self.buffer[name]) for name in POOL_TENSORS]
        self.routes: dict[int, Any] = {}

    def __call__(self, layer: Any, num_tokens: int) -> dict[str, Any]:
        import torch
        from vllm.model_executor.layers.fused_moe.expert_pool.bank import copy_pool_rows

        need = routed_nonresident(self.tables, layer.index, self.routes[layer.index])
        rows = torch.argsort(need.to(torch.int8), descending=True, stable=True).to(torch.int32)
        count = need.sum(dtype=torch.int32).view(1)
        copy_pool_rows(layer.copy_views()[0], self.words, rows, rows, count)
        return self.buffer

    def release(self, layer: Any) -> None:
        """Nothing to free: the compute stream orders every use of the buffer."""


def routed_nonresident_rows(replay: Replay, routes: Any) -> list[int]:
    """Per layer, routed experts outside the bank (read on the host, outside any timing)."""
    tables = replay.pool.tables
    return [
        int(routed_nonresident(tables, layer.index, ids).sum().item())
        for layer, (ids, _) in zip(replay.pool.layers, routes, strict=True)
    ]


def series_choice(staged: bool) -> str:
    """The mode the series runs at a width: the cost model's choice."""
    return "staged" if staged else "host_view"


def gains(entry: dict[str, Any]) -> dict[str, float]:
    """``routed`` against the host view and against what the series does."""
    routed = entry["routed_ms"]
    return {
        "host_view_over_routed": entry["host_view_ms"] / routed,
        "series_over_routed": entry[f"{series_choice(entry['series_stages'])}_ms"] / routed,
    }


def time_steps(step: Any, reps: int) -> float:
    """Median ms of ``reps`` steps, each between CUDA events, after one untimed step."""
    import torch

    step()
    torch.cuda.synchronize()
    return statistics.median(event_times_ms(step, reps))


def _equal(outputs: list[Any], reference: list[Any]) -> bool:
    import torch

    return all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True))


def probe_size(replay: Replay, proto: RoutedOnly, tokens: int, reps: int) -> dict[str, Any]:
    import torch

    x, routes = replay.chunk_inputs(tokens, 1)[0]
    rows = routed_nonresident_rows(replay, routes)
    expert_bytes = sum(replay.row_bytes.values())
    first = replay.pool.layers[0]
    replay.set_mode("staged")  # the cost model as configured (``--min-tokens``)
    entry: dict[str, Any] = {
        "tokens": tokens,
        "routed_nonresident_rows": sum(rows),
        "routed_nonresident_bytes": sum(rows) * expert_bytes,
        "nonresident_bytes": replay.residency()["nonresident_bytes_per_step"],
        "series_stages": replay.stager.cost.stages(
            tokens, first.block_size_for(tokens, replay.stager.cost.top_k)
        ),
    }
    outputs: dict[str, list[Any]] = {}
    for mode in MODES:
        if mode == "routed":
            for layer in replay.pool.layers:
                layer.stager = proto
            proto.routes = {
                layer.index: ids for layer, (ids, _) in zip(replay.pool.layers, routes, strict=True)
            }

            def step_fn(routes: Any = routes) -> list[Any]:
                replay.stager.note_step()  # as Replay.step does for the other modes
                return replay.pool_step(x, routes)
        else:
            replay.set_mode(mode, min_tokens=tokens if mode == "staged" else None)

            def step_fn(routes: Any = routes) -> list[Any]:
                return replay.step(x, routes)

        entry[f"{mode}_ms"] = time_steps(step_fn, reps)
        outputs[mode] = step_fn()
        if mode == "host_view":
            outputs["host_view_again"] = step_fn()
        torch.cuda.synchronize()
    replay.set_mode("staged")
    reference = outputs["host_view"]
    # Marlin is not bitwise repeatable at every width: equality to the host view
    # means something only where the host view equals itself.
    entry["host_view_repeatable"] = _equal(outputs["host_view_again"], reference)
    for mode in ("routed", "staged"):
        entry[f"{mode}_bitwise_equal"] = _equal(outputs[mode], reference)
        entry[f"{mode}_max_abs_diff"] = max(
            float((a.float() - b.float()).abs().max())
            for a, b in zip(outputs[mode], reference, strict=True)
        )
    # Routed bytes over the whole routed step (copy and Marlin), not the copy's rate.
    entry["routed_step_gbps"] = entry["routed_nonresident_bytes"] / (entry["routed_ms"] / 1e3) / 1e9
    entry.update(gains(entry))
    return entry


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    data: dict[str, Any] = {"errors": [], "sizes": args.sizes, "reps": args.reps}
    data["pinned_h2d"] = pinned_h2d_bandwidth(args.bw_bytes, 5)
    replay = Replay(args)
    data["setup"] = {
        "layers": args.layers,
        "experts": args.experts,
        "rows_per_layer": args.rows,
        "decode_tokens": args.decode_tokens,
        "expert_bytes": sum(replay.row_bytes.values()),
    }
    data["residency"] = replay.shuffle_residency(args.shuffle_rounds)
    data["uva_copy"] = replay.uva_copy_bandwidth(3)
    proto = RoutedOnly(replay)
    data["steps"] = []
    for tokens in args.sizes:
        try:
            data["steps"].append(probe_size(replay, proto, tokens, args.reps))
        except Exception as exc:  # keep the widths already measured
            data["errors"].append(f"{tokens} tokens: {type(exc).__name__}: {exc}")
            break
    data["seconds"] = time.monotonic() - started
    return data


def print_table(data: dict[str, Any]) -> None:
    print(
        f"pinned H2D {data['pinned_h2d']['gbps_median']:.1f} GB/s; copy kernel through the "
        f"host view {data['uva_copy']['gbps_median']:.1f} GB/s"
    )
    print(
        f"{'tokens':>6} {'routed GiB':>10} {'host view':>10} {'routed':>8} {'staged':>8} "
        f"{'series':>9} {'hv/routed':>9} {'series/routed':>13} "
        f"{'bitwise routed/staged/hv again':>30}"
    )
    for e in data["steps"]:
        print(
            f"{e['tokens']:>6} {e['routed_nonresident_bytes'] / (1 << 30):>10.2f} "
            f"{e['host_view_ms']:>10.1f} {e['routed_ms']:>8.1f} {e['staged_ms']:>8.1f} "
            f"{series_choice(e['series_stages']):>9} {e['host_view_over_routed']:>9.3f} "
            f"{e['series_over_routed']:>13.3f} "
            f"{e['routed_bitwise_equal']!s:>10}/{e['staged_bitwise_equal']!s}/"
            f"{e['host_view_repeatable']!s}"
        )
    for error in data["errors"]:
        print(f"error: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Other options go to scripts/staging_replay.py's parser, which builds the "
        "layer stack: --min-tokens (the stager's threshold), --host-sets, --seed, "
        "--shuffle-rounds, --bw-bytes (the pinned H2D probe's size).",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rows", type=int, default=192, help="pool rows per layer")
    parser.add_argument("--layers", type=int, default=42)
    parser.add_argument(
        "--sizes",
        type=lambda v: [int(x) for x in v.split(",")],
        default=list(DEFAULT_SIZES),
        help="step widths in tokens, comma-separated (wider than --decode-tokens)",
    )
    parser.add_argument("--reps", type=int, default=5, help="timed steps per width and mode")
    parser.add_argument(
        "--decode-tokens", type=int, default=8, help="the pool's decode lanes / top-k"
    )
    ours, rest = parser.parse_known_args(argv)
    if min(ours.sizes) <= ours.decode_tokens:
        parser.error("every --sizes width must exceed --decode-tokens (a partition step)")
    args = parse_args(
        [
            "--out", str(ours.out), "--experts", str(ours.experts), "--rows", str(ours.rows),
            "--layers", str(ours.layers), "--decode-tokens", str(ours.decode_tokens), *rest,
        ]
    )  # fmt: skip
    args.sizes, args.reps = ours.sizes, ours.reps
    _need_stage()
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(replay_vllm_config(max(args.sizes))):
        try:
            data = run(args)
        except Exception as exc:
            data = {"failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    path = write_result(args.out, "routed_copy_probe", data)
    print(f"wrote {path}")
    if "failed" in data:
        print(data["traceback"], file=sys.stderr)
        return 1
    print_table(data)
    return 1 if data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
