# SPDX-License-Identifier: Apache-2.0
"""Record the allocations of FlashInfer's real ``B12xMoEWrapper`` constructor.

Runs on CPU. It builds the real ``flashinfer.fused_moe.B12xMoEWrapper``
(flashinfer-python 0.7.2.post1, ``use_cuda_graph=True``) with
``device="cpu"`` for each geometry below, and records every new tensor
storage the constructor allocates, in order, through a
``TorchDispatchMode``. Storages still referenced by the finished wrapper
(its static and dynamic workspaces and its output buffer) are marked
``retained``; the others were temporaries. The result is the
allocation-size trace that ``b12x_oom_replay.py`` replays on a GPU with
plain allocations when FlashInfer itself cannot be carried there.

The constructor has no GPU-architecture gate; it only needs
``nvidia-cutlass-dsl`` importable and a CUDA >= 13 toolkit version (read
from ``nvcc --version``). Nothing is compiled or launched.

The trace is written through ``harness.results`` (kind ``b12x-alloc-trace``:
provenance, and the cases under ``data``). Usage, from the repository root
(flashinfer and its DSL dependencies installed with ``pip install --target
DIR``, never into a shared environment)::

    PYTHONPATH=.:DIR:DIR/nvidia_cutlass_dsl/dsl_packages \\
        python scripts/b12x_alloc_trace.py --out results/b12x/b12x_alloc_trace.json
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import results

# Geometries (num_experts, top_k, hidden, intermediate per partition) from
# the checkpoints' configs as summarized in shared/design/b12x.md, section 1.2.
GEOMETRIES: dict[str, dict[str, int]] = {
    # Qwen3.6-35B-A3B: E=256, K=8, H=2048, I=512, 40 MoE layers.
    "qwen36_35b": dict(num_experts=256, top_k=8, hidden=2048, intermediate=512),
    # One DP rank of the same model without EP: MoE TP is flattened across
    # DP, so each of 2 ranks holds I/2.
    "qwen36_35b_dp2_rank": dict(num_experts=256, top_k=8, hidden=2048, intermediate=256),
    # Qwen3.5-397B-A17B, one TP4 rank: E=512, K=10, H=4096, I=1024/4.
    "qwen35_397b_tp4_rank": dict(num_experts=512, top_k=10, hidden=4096, intermediate=256),
}

# (geometry, capacity in tokens, activation) pairs to trace.
CASES: list[tuple[str, int, str]] = [
    ("qwen36_35b", 2048, "silu"),
    ("qwen36_35b", 8192, "silu"),
    ("qwen36_35b_dp2_rank", 8192, "silu"),
    ("qwen36_35b_dp2_rank", 16384, "silu"),
    ("qwen35_397b_tp4_rank", 16384, "silu"),
]


class _AllocationRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records each op output whose storage was not seen alive before."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.events: list[dict[str, Any]] = []
        self._alive: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            seen = self._alive.get(ptr)
            if seen is not None and seen() is not None:
                continue
            self._alive[ptr] = weakref.ref(storage)
            self.events.append(
                dict(
                    op=str(func),
                    shape=list(t.shape),
                    dtype=str(t.dtype),
                    nbytes=nbytes,
                    ptr=ptr,
                )
            )
        return out


def _storages(obj: Any, found: dict[int, int]) -> None:
    """Collects ``{data_ptr: nbytes}`` of tensors reachable from ``obj``."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _storages(getattr(obj, field.name), found)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _storages(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _storages(item, found)


def trace_case(geom: str, capacity: int, activation: str) -> dict[str, Any]:
    """Builds one real wrapper on CPU and returns its allocation trace."""
    from flashinfer.fused_moe import B12xMoEWrapper

    g = GEOMETRIES[geom]
    recorder = _AllocationRecorder()
    with recorder:
        wrapper = B12xMoEWrapper(
            g["num_experts"],
            g["top_k"],
            g["hidden"],
            g["intermediate"],
            use_cuda_graph=True,
            max_num_tokens=capacity,
            output_dtype=torch.bfloat16,
            device="cpu",
            activation=activation,
        )
    parts: dict[str, dict[int, int]] = {}
    for name in ("_static_workspace", "_dynamic_workspace", "_moe_output"):
        found: dict[int, int] = {}
        _storages(getattr(wrapper, name), found)
        parts[name] = found
    retained_ptrs = {ptr for found in parts.values() for ptr in found}
    # The latest allocation at a retained address is the retained one.
    last_at: dict[int, int] = {}
    for i, event in enumerate(recorder.events):
        last_at[event["ptr"]] = i
    allocations = []
    for i, event in enumerate(recorder.events):
        retained = event["ptr"] in retained_ptrs and last_at[event["ptr"]] == i
        entry = {k: v for k, v in event.items() if k != "ptr"}
        entry["retained"] = retained
        allocations.append(entry)
    retained_bytes = sum(a["nbytes"] for a in allocations if a["retained"])
    walked_bytes = sum(sum(found.values()) for found in parts.values())
    assert retained_bytes == walked_bytes, (retained_bytes, walked_bytes)
    return dict(
        geometry=geom,
        **g,
        max_num_tokens=capacity,
        activation=activation,
        quant_mode=wrapper.quant_mode,
        has_dynamic_workspace=wrapper._dynamic_workspace is not None,
        bytes_per_part={name: sum(found.values()) for name, found in parts.items()},
        retained_bytes=retained_bytes,
        retained_mib=round(retained_bytes / 2**20, 2),
        temporary_bytes=sum(a["nbytes"] for a in allocations if not a["retained"]),
        allocations=allocations,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import flashinfer

    cases = [trace_case(*case) for case in CASES]
    for case in cases:
        print(
            f"{case['geometry']:>22} T={case['max_num_tokens']:>6} "
            f"{case['activation']}: {case['retained_mib']} MiB retained in "
            f"{sum(a['retained'] for a in case['allocations'])} allocations"
        )
    data = dict(
        description="allocation trace of the real FlashInfer B12xMoEWrapper constructor",
        cases=cases,
    )
    prov = results.provenance(
        [Path(sys.executable).name, *sys.argv],
        flashinfer_version=str(flashinfer.__version__),
        flashinfer_file=str(flashinfer.__file__),
        platform=f"{platform.system()} {platform.machine()}",
        device="cpu",
    )
    results.write(Path(args.out), "b12x-alloc-trace", data, prov)


if __name__ == "__main__":
    main()
