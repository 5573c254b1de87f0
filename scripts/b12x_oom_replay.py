# SPDX-License-Identifier: Apache-2.0
"""Allocation-size replay of the FlashInfer B12x MoE workspace OOM.

vLLM 0.33.0 builds one FlashInfer ``B12xMoEWrapper`` per MoE layer, and each
wrapper allocates its own persistent scratch (vLLM issues #47982, #49476).
The series' fix shares one wrapper per geometry. This script compares the
two ownership policies on one GPU under a memory cap that emulates a
smaller card:

* ``stock``: one wrapper's buffers per MoE layer, allocated layer by layer
  (as the first ``apply()`` of each layer does inside ``profile_run``);
* ``patched``: one wrapper's buffers for all layers.

What is replayed is an *allocation-size replay*, not FlashInfer itself: the
ordered list of buffers that FlashInfer 0.7.2.post1's real constructor
allocates (recorded on CPU by ``b12x_alloc_trace.py`` into
``results/b12x/b12x_alloc_trace.json``) is allocated with
``torch.empty(nbytes, dtype=torch.uint8)`` through PyTorch's caching
allocator, which is how FlashInfer's own ``torch.empty``/``torch.zeros``
calls allocate. Only the constructor's retained buffers are replayed; its
short-lived temporaries are listed in the trace and are not replayed.

Emulated: the card's capacity, with
``torch.cuda.set_per_process_memory_fraction`` (it caps PyTorch's allocator
only, not the CUDA context or other non-PyTorch memory), and the model
weights, with one ballast allocation. No activations, KV cache or CUDA
graphs are replayed, so the stock OOM shown here is conservative.

Each case runs in its own process (``--case``); without it, the script runs
every case in subprocesses and writes one result file through
``harness.results`` (kind ``b12x-oom-replay``: provenance, and the cases under
``data``). It runs from the repository root (the whole repository travels to
the GPU host)::

    PYTHONPATH=. python3 scripts/b12x_oom_replay.py --out results/b12x/b12x_oom_replay_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import results

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE.parent / "results" / "b12x" / "b12x_alloc_trace.json"
GIB = 1 << 30

# Card capacities in GiB as reported by PyTorch / vLLM logs on those cards
# (shared/design/b12x.md section 4.3, from the logs in #47982 and #49476).
BUDGETS_GIB: dict[str, float] = {
    "rtx5090_32gb": 31.40,
    "rtx_pro_6000_96gb": 95.59,
}

# name -> (trace geometry, capacity, MoE layers, weight ballast GiB, budget)
# Ballast: 21.94 GiB is the weight memory #47982 reports for
# nvidia/Qwen3.6-35B-A3B-NVFP4; 52.5 GiB per rank is #4603's figure for
# Qwen3.5-397B-A17B at TP4 (both via shared/design/b12x.md).
CASES: dict[str, dict[str, Any]] = {
    "A_rtx5090_qwen36_T8192": dict(
        geometry="qwen36_35b",
        capacity=8192,
        layers=40,
        ballast_gib=21.94,
        budget="rtx5090_32gb",
    ),
    "A2_rtx5090_qwen36_T2048": dict(
        geometry="qwen36_35b",
        capacity=2048,
        layers=40,
        ballast_gib=21.94,
        budget="rtx5090_32gb",
    ),
    "B_pro6000_qwen36_T8192": dict(
        geometry="qwen36_35b",
        capacity=8192,
        layers=40,
        ballast_gib=21.94,
        budget="rtx_pro_6000_96gb",
    ),
    "C_pro6000_qwen35_397b_tp4rank_T16384": dict(
        geometry="qwen35_397b_tp4_rank",
        capacity=16384,
        layers=60,
        ballast_gib=52.5,
        budget="rtx_pro_6000_96gb",
    ),
    # DP2 without EP: a rank holds I/2 and the gathered batch is 2 x 8192.
    # Stock sizes each layer for 8192 and then fails the capacity check
    # (#47982); scaling every per-layer wrapper by DP instead is shown here.
    "D_rtx5090_qwen36_dp2rank_T16384": dict(
        geometry="qwen36_35b_dp2_rank",
        capacity=16384,
        layers=40,
        ballast_gib=21.94 / 2,
        budget="rtx5090_32gb",
    ),
}


def _find_trace(trace: dict[str, Any], geometry: str, capacity: int) -> dict[str, Any]:
    """The traced wrapper of ``geometry`` at ``capacity`` in a ``b12x-alloc-trace`` result."""
    for case in trace["data"]["cases"]:
        if case["geometry"] == geometry and case["max_num_tokens"] == capacity:
            found: dict[str, Any] = case
            return found
    raise KeyError((geometry, capacity))


def run_case(name: str, mode: str, trace_path: Path) -> dict[str, Any]:
    """Runs one (case, mode) replay in this process and returns its record."""
    import torch

    spec = CASES[name]
    trace = json.loads(trace_path.read_text())
    wrapper_trace = _find_trace(trace, spec["geometry"], spec["capacity"])
    sizes = [a["nbytes"] for a in wrapper_trace["allocations"] if a["retained"]]

    torch.cuda.init()  # type: ignore[no-untyped-call]
    total = torch.cuda.get_device_properties(0).total_memory
    budget = int(BUDGETS_GIB[spec["budget"]] * GIB)
    fraction = budget / total
    # Set before any allocation.
    torch.cuda.set_per_process_memory_fraction(fraction, 0)

    record: dict[str, Any] = dict(
        case=name,
        mode=mode,
        **spec,
        budget_gib=BUDGETS_GIB[spec["budget"]],
        memory_fraction=fraction,
        device_total_bytes=total,
        per_wrapper_bytes=sum(sizes),
        per_wrapper_allocations=len(sizes),
        replayed="allocation sizes of FlashInfer 0.7.2.post1 B12xMoEWrapper",
    )
    ballast = torch.empty(int(spec["ballast_gib"] * GIB), dtype=torch.uint8, device="cuda")
    record["after_ballast_allocated"] = torch.cuda.memory_allocated()

    def build_wrapper() -> list[Any]:
        return [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]

    per_layer: list[dict[str, int]] = []
    wrappers: list[list[Any]] = []
    layer_wrapper: list[int] = []
    record["oom_at_layer"] = None
    t0 = time.perf_counter()
    for layer in range(spec["layers"]):
        try:
            if mode == "stock" or not wrappers:
                wrappers.append(build_wrapper())
            layer_wrapper.append(len(wrappers) - 1)
        except torch.OutOfMemoryError as e:
            record["oom_at_layer"] = layer  # 0-based index of the failing layer
            record["oom_message"] = str(e).splitlines()[0][:400]
            break
        per_layer.append(
            dict(
                layer=layer,
                allocated=torch.cuda.memory_allocated(),
                reserved=torch.cuda.memory_reserved(),
                max_allocated=torch.cuda.max_memory_allocated(),
            )
        )
    record["seconds"] = round(time.perf_counter() - t0, 3)
    record["layers_built"] = len(layer_wrapper)
    record["wrappers_built"] = len(wrappers)
    record["fits"] = record["oom_at_layer"] is None
    record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    record["workspace_bytes"] = torch.cuda.memory_allocated() - record["after_ballast_allocated"]
    record["headroom_under_budget_gib"] = round(
        (budget - torch.cuda.max_memory_reserved()) / GIB, 3
    )
    record["per_layer"] = per_layer

    # Lifecycle: dropping the owners returns the memory to the ballast.
    wrappers.clear()
    record["after_release_allocated"] = torch.cuda.memory_allocated()
    record["released_to_ballast"] = (
        record["after_release_allocated"] == record["after_ballast_allocated"]
    )
    del ballast
    return record


def _provenance(args: argparse.Namespace) -> dict[str, Any]:
    """``harness.results`` provenance plus the device's capability and the trace used."""
    import torch

    props = torch.cuda.get_device_properties(0)
    traced = json.loads(args.trace.read_text())["provenance"]
    prov = results.provenance(
        [Path(sys.executable).name, *sys.argv],
        compute_capability=f"{props.major}.{props.minor}",
        trace=str(args.trace),
        trace_flashinfer_version=str(traced.get("flashinfer_version", "not recorded")),
    )
    prov["total_memory_bytes"] = props.total_memory
    return prov


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--mode", choices=["stock", "patched"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    if args.case:
        print(json.dumps(run_case(args.case, args.mode, args.trace)))
        return

    records = []
    for name in CASES:
        for mode in ("stock", "patched"):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--trace",
                    str(args.trace),
                    "--case",
                    name,
                    "--mode",
                    mode,
                ],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ""},
            )
            if proc.returncode != 0:
                records.append(dict(case=name, mode=mode, error=proc.stderr[-2000:]))
                print(name, mode, "ERROR", proc.stderr[-500:])
                continue
            rec = json.loads(proc.stdout.strip().splitlines()[-1])
            records.append(rec)
            print(
                f"{name:>38} {mode:>7}: wrappers={rec['wrappers_built']:>3} "
                f"layers={rec['layers_built']:>3}/{rec['layers']} "
                f"oom_at_layer={rec['oom_at_layer']} "
                f"peak={rec['peak_allocated_gib']} GiB "
                f"per_wrapper={rec['per_wrapper_bytes'] / 2**20:.1f} MiB"
            )
    data = dict(
        description="allocation-size replay (not the real FlashInfer kernels/wrapper)",
        emulated=(
            "card capacity via torch.cuda.set_per_process_memory_fraction "
            "(PyTorch allocator only; CUDA context not counted); weights via "
            "one ballast allocation; no activations, KV cache or CUDA graphs"
        ),
        budgets_gib=BUDGETS_GIB,
        results=records,
    )
    if args.out:
        results.write(args.out, "b12x-oom-replay", data, _provenance(args))


if __name__ == "__main__":
    main()
