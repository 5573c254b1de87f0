"""Shared pieces of the Marlin MoE replays (``marlin_bound.py``, ``marlin_ab.py``).

Torch plus the harness's result writer: run the scripts from the repository root
with ``PYTHONPATH=.`` so that ``import harness`` resolves. The Marlin ops come
from standalone libraries built by :func:`harness.kernels.build_kernels`
(``lib<ns>.so`` with ``torch.ops.<ns>``), named on the command line as
``PATH:NAMESPACE``. Their ``lib<ns>.json`` manifests (next to the library)
supply the tree commit for provenance.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch

from harness import results

NVFP4_TYPE_ID = 0x2000000010102  # vllm.scalar_type.scalar_types.float4_e2m1f.id
GPTQ4_TYPE_ID = 1125899907892224  # scalar_types.uint4b8.id (GPTQ int4)
GROUP = 16
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
FP4_TABLE = torch.tensor(FP4_VALUES + [-v for v in FP4_VALUES])
SCALE_PERM = [i + 8 * j for i in range(8) for j in range(8)]


@dataclasses.dataclass(frozen=True)
class Lib:
    """One standalone Marlin library: ``path`` registering ``torch.ops.<namespace>``."""

    path: Path
    namespace: str

    @classmethod
    def parse(cls, spec: str) -> Lib:
        path, sep, namespace = spec.rpartition(":")
        if not sep or not path or not namespace:
            raise SystemExit(f"library spec {spec!r} must be PATH:NAMESPACE")
        return cls(Path(path).resolve(), namespace)

    @property
    def spec(self) -> str:
        return f"{self.path}:{self.namespace}"

    def load(self) -> Any:
        torch.ops.load_library(str(self.path))
        return getattr(torch.ops, self.namespace)

    def manifest(self) -> dict[str, Any]:
        path = self.path.with_suffix(".json")
        return json.loads(path.read_text()) if path.exists() else {}


@dataclasses.dataclass
class Expert:
    qweight: torch.Tensor  # (K/16, 2N) int32 Marlin layout, on the GPU
    scales: torch.Tensor  # (K/16, N) float8_e4m3fn Marlin layout, on the GPU
    global_scale: float  # Marlin-rescaled for bf16
    weight: torch.Tensor  # (N, K) float32 dequantized, on the CPU


def optional(op: Any, name: str, value: object) -> list[object]:
    """``[value]`` when the op's schema has argument ``name``, else ``[]``: vLLM 0.33.0's
    Marlin ops take 8-bit-activation arguments (``a_scales``, ``is_a_8bit``) that
    0.34.0 removed, and the standalone builds follow the tree they are built from."""
    return [value] if any(a.name == name for a in op.default._schema.arguments) else []


def make_expert(ops: Any, size_n: int, size_k: int, seed: int) -> Expert:
    """A random NVFP4 expert prepared like vLLM's NVFP4 Marlin loader does."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (size_n, size_k // 2), generator=gen).to(torch.uint8)
    choices = torch.tensor([0.25, 0.375, 0.5, 0.75, 1.0, 1.5])
    pick = torch.randint(0, len(choices), (size_n, size_k // GROUP), generator=gen)
    scales = choices[pick].to(torch.float8_e4m3fn)
    gscale = 1.0 / 64
    codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(size_n, size_k)
    weight = FP4_TABLE[codes.long()] * scales.float().repeat_interleave(GROUP, 1) * gscale
    qweight = ops.gptq_marlin_repack(
        packed.view(torch.int32).T.contiguous().cuda(), size_k, size_n, 4,
        *optional(ops.gptq_marlin_repack, "is_a_8bit", False),
    )  # fmt: skip
    s = scales.T.to(torch.half).reshape(-1, 64)[:, SCALE_PERM].reshape(-1, size_n)
    s = s.contiguous().view(-1, 4)[:, [0, 2, 1, 3]].reshape(s.shape[0], -1) * 2**7
    s[s < 2] = 0
    s = (s.view(torch.int16) << 1).view(torch.float8_e4m3fn)[:, 1::2].contiguous()
    return Expert(qweight, s.cuda(), gscale * 2.0 ** (126 - 7), weight)


@dataclasses.dataclass
class Routing:
    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_past_padded: torch.Tensor
    block_size: int
    top_k: int


def route(topk_ids: torch.Tensor, rows: list[int], block_size: int) -> Routing:
    """Hand-made ``moe_align_block_size``: logical experts -> padded blocks -> bank rows."""
    flat = topk_ids.flatten()
    sentinel = flat.numel()
    ids, blocks = [], []
    for expert in range(len(rows)):
        slots = (flat == expert).nonzero().flatten()
        if slots.numel() == 0:
            continue
        padded = -(-slots.numel() // block_size) * block_size
        ids.append(torch.cat([slots, torch.full((padded - slots.numel(),), sentinel)]))
        blocks += [rows[expert]] * (padded // block_size)
    sorted_ids = torch.cat(ids).to(torch.int32)
    return Routing(
        sorted_ids.cuda(),
        torch.tensor(blocks, dtype=torch.int32, device="cuda"),
        torch.tensor([sorted_ids.numel()], dtype=torch.int32, device="cuda"),
        block_size,
        topk_ids.shape[1],
    )


def block_size_for(num_tokens: int, top_k: int, num_experts: int) -> int:
    """vLLM 0.33.0's Marlin MoE block-size rule (experts/marlin_moe.py)."""
    for size in (8, 16, 32, 48, 64):
        if num_tokens * top_k / num_experts / size < 0.9:
            return size
    return 64


def gemm(
    ops: Any,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    routing: Routing,
    workspace: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    thread_k: int = -1,
    thread_n: int = -1,
    topk_weights: torch.Tensor | None = None,
    blocks_per_sm: int = -1,
    b_type_id: int = NVFP4_TYPE_ID,
) -> torch.Tensor:
    """One deterministic launch (no atomics, fp32 reduce, unweighted).

    NVFP4 by default; ``b_type_id=GPTQ4_TYPE_ID`` with ``global_scale=None``
    and 16-bit group scales for GPTQ int4.
    """
    size_m, size_k = x.shape
    size_n = scales.shape[2]
    if topk_weights is None:
        topk_weights = torch.ones((size_m, routing.top_k), dtype=torch.float32, device="cuda")
    op = ops.moe_wna16_marlin_gemm
    return op(
        x, out, qweight, None, scales, *optional(op, "a_scales", None), global_scale, None,
        workspace,
        routing.sorted_token_ids, routing.expert_ids, routing.num_tokens_past_padded,
        topk_weights, routing.block_size, routing.top_k, False, b_type_id,
        size_m, size_n, size_k, False, True, False, thread_k, thread_n, blocks_per_sm,
    )  # fmt: skip


def workspace() -> torch.Tensor:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return torch.zeros(sms * 4, dtype=torch.int32, device="cuda")


def provenance(libs: dict[str, Lib]) -> dict[str, Any]:
    """Harness provenance plus each library's revision, commit and sha256.

    The harness part (:func:`harness.results.provenance`) records command, date,
    host, GPU, driver, CUDA, torch, Python and the vLLM base pin.
    """
    prov = results.provenance([Path(sys.executable).name, *sys.argv])
    prov["libraries"] = {
        name: {
            "spec": lib.spec,
            **{key: lib.manifest().get(key) for key in ("rev", "commit", "sha256", "arch")},
        }
        for name, lib in libs.items()
    }
    return prov
