"""The synthetic checkpoint at the seed's per-GPU expert shape, with stated routing (numpy).

:mod:`harness.checkpoint` writes a small model with the standard library; at the
seed's scale (42 MoE layers x 128 experts of hidden 4096 and moe intermediate
1024, about 36 GiB of NVFP4 experts) drawing bytes in pure Python would take
hours. This module writes the same layout (:func:`harness.checkpoint.layout`)
with numpy, in parallel worker processes, on the machine that serves it (the
checkpoint is never carried). Each tensor's values come from its own generator
seeded by ``(spec.seed, crc32(name))``, so the bytes do not depend on the
number of workers or on which shard a tensor lands in.

**Routing is stated, not accidental.** Expert choice in a model with random
weights would be whatever the noise gives. Here the hidden state that reaches
every router is made to carry one fixed direction ``c`` (entries +-1) on top of
a token-dependent part, and each router reads a logit bias along ``c``:

* ``embed_tokens[v] = A * c + e_v`` with ``e_v ~ N(0, 1)`` per entry and
  ``A = 4`` (:data:`COMMON`). Attention's ``o_proj`` and the experts' down
  projections get a tenfold smaller global scale (:data:`OUT_SCALE_2`), so the
  residual stream stays dominated by ``A * c + e_v`` through all layers;
* router row ``e`` of layer ``l`` is ``log p[l, e] * r / (A * d) * c + g_e``
  with ``r = sqrt(A^2 + 1)`` the hidden state's RMS before normalisation,
  ``d`` the hidden size and ``g_e ~ N(0, s^2)`` orthogonal to ``c``, ``s = tau *
  r / sqrt(d)``. After the RMS norm the logit is ``log p[l, e]`` plus
  token-dependent noise of standard deviation ``tau = pi / sqrt(6)`` (a Gumbel
  variable's), so top-k choice approximates sampling experts without
  replacement with probabilities ``p[l]`` (Plackett-Luce);
* ``uniform``: ``p[l, e] = 1 / E``; ``skewed``: Zipf with exponent
  ``spec.zipf_s`` over a per-layer random permutation of the experts,
  ``p[l, perm_l(k)] ~ 1 / (k + 1)^s``. Zipf with s = 1 is the usual first model
  of popularity skew (word frequencies, cache traces); the per-layer
  permutation keeps a global LRU from seeing the same hot experts in every
  layer;
* ``lm_head`` rows are drawn orthogonal to ``c`` and to every embedding row, so
  the next token depends on what attention and the experts added (the
  context), not on the current token alone: greedy decode does not fall into
  a short cycle.

The two routers differ only in the 42 router matrices: :func:`write` writes
every other tensor once under ``OUT/shared/`` and one folder per router
(``OUT/uniform``, ``OUT/skewed``) with its own configs, index, router shard and
hard links to the shared shards. :func:`routing_check` draws hidden states the
way the model builds them and reports the expert popularity the routers give
(a test compares it with ``p``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import shutil
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import checkpoint
from harness.checkpoint import LINEAR_KINDS, Part, Spec, Tensor

if TYPE_CHECKING:  # numpy is imported where it is used: the harness itself needs none
    import numpy as np

ROUTERS = ("uniform", "skewed")
COMMON = 4.0  # amplitude of the shared hidden direction c
# Router noise std. Top-k of log p + Gaussian noise of std 1.6 puts the same share of
# choices on the hottest experts as top-k of log p + Gumbel noise (ideal Plackett-Luce
# sampling) within about a point at 128 experts, top-8 (see routing_check).
TAU = 1.6
IN_SCALE_2 = checkpoint._Weights.WEIGHT_SCALE_2  # global scale of input-side linears
OUT_SCALE_2 = IN_SCALE_2 / 10  # o_proj and expert down_proj: keep the residual near A*c + e
STAMP = "spec.json"

#: The seed's per-GPU expert shape (GLM-5.3-Flash NVFP4 at TP=2: moe intermediate
#: 2048 split in two), with real attention (32 query / 4 KV heads of 128) and a
#: small vocabulary. ``--experts 256`` gives the 256-expert variant (about 72 GiB).
GLM_SHAPE = Spec(
    layers=42,
    experts=128,
    top_k=8,
    hidden_size=4096,
    moe_intermediate_size=1024,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=512,
    max_position_embeddings=131072,
    shard_bytes=1 << 30,
)
PRESETS = {"glm-shape": GLM_SHAPE}


def bytes_per_expert(spec: Spec) -> int:
    """Bytes of one routed expert's weights and block scales (its three linears)."""
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    return 3 * inter * h // 2 + 3 * inter * h // checkpoint.GROUP_SIZE


def expert_bytes(spec: Spec) -> int:
    """Bytes of routed-expert weights and block scales in the checkpoint."""
    return spec.layers * spec.experts * bytes_per_expert(spec)


def part_bytes(part: Part) -> int:
    """Bytes one layout entry takes in the checkpoint (an NVFP4 linear's four tensors)."""
    n = math.prod(part.shape)
    if part.kind in LINEAR_KINDS:
        return n // 2 + n // checkpoint.GROUP_SIZE + 8  # weight, block scales, two scalars
    return 2 * n


def other_bytes(spec: Spec) -> int:
    """Bytes of every tensor but the routed experts (attention, norms, routers, embeddings)."""
    return sum(
        part_bytes(part)
        for part in checkpoint.layout(spec)
        if part.kind not in ("expert", "expert_out")
    )


# --- values ---------------------------------------------------------------------------------------


def _rng(spec: Spec, name: str) -> np.random.Generator:
    import numpy as np

    return np.random.default_rng([spec.seed, zlib.crc32(name.encode())])


def _bf16(values: np.ndarray) -> bytes:
    """bfloat16 bytes of a float array (round to nearest even)."""
    import numpy as np

    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bytes(rounded.astype("<u2").tobytes())


def _nvfp4(spec: Spec, part: Part) -> list[tuple[str, Tensor]]:
    """The four tensors of one NVFP4 linear, drawn from the part's own generator."""
    import numpy as np

    out, inp = part.shape
    rng = _rng(spec, part.name)
    weight = rng.bytes(out * inp // 2)  # any byte is two finite e2m1 values
    # Positive, finite e4m3 block scales in [0.5, 1.875], as the small writer draws them.
    table = np.array([((6 + i // 8) << 3) | (i % 8) for i in range(16)], dtype=np.uint8)
    picks = np.frombuffer(rng.bytes(out * inp // checkpoint.GROUP_SIZE), dtype=np.uint8) & 15
    scale_2 = OUT_SCALE_2 if part.kind in ("linear_out", "expert_out") else IN_SCALE_2
    return [
        (f"{part.name}.weight", Tensor("U8", (out, inp // 2), weight)),
        (f"{part.name}.weight_scale", Tensor("F8_E4M3", (out, inp // 16), table[picks].tobytes())),
        (f"{part.name}.weight_scale_2", Tensor("F32", (), checkpoint.f32_scalar(scale_2))),
        (f"{part.name}.input_scale", Tensor("F32", (), checkpoint.f32_scalar(
            checkpoint._Weights.INPUT_SCALE))),
    ]  # fmt: skip


@dataclasses.dataclass
class Dense:
    """The matrices that shape routing: shared direction, embeddings, lm_head, routers."""

    spec: Spec
    common: np.ndarray  # c, entries +-1
    embed: np.ndarray  # (vocab, hidden) float32
    lm_head: np.ndarray
    noise: np.ndarray  # (layers, experts, hidden): g, orthogonal to c

    @classmethod
    def draw(cls, spec: Spec) -> Dense:
        import numpy as np

        d = spec.hidden_size
        common = np.where(_rng(spec, "common").random(d) < 0.5, -1.0, 1.0)
        embed = COMMON * common + _rng(spec, "model.embed_tokens.weight").standard_normal(
            (spec.vocab_size, d)
        )
        # lm_head orthogonal to c and to every embedding row: an orthonormal basis of
        # their span, then each drawn row minus its projection on it.
        basis, _ = np.linalg.qr(np.concatenate([common[None, :], embed]).T)
        lm = 0.02 * _rng(spec, "lm_head.weight").standard_normal((spec.vocab_size, d))
        lm -= (lm @ basis) @ basis.T
        r = math.sqrt(COMMON**2 + 1)
        s = TAU * r / math.sqrt(d)
        noise = s * _rng(spec, "router-noise").standard_normal((spec.layers, spec.experts, d))
        noise -= np.einsum("lej,j->le", noise, common)[..., None] * common / d
        return cls(spec, common, embed, lm, noise)

    def log_popularity(self, router: str) -> np.ndarray:
        """``log p[l, e]``, shape (layers, experts)."""
        import numpy as np

        spec = self.spec
        if router == "uniform":
            return np.full((spec.layers, spec.experts), -math.log(spec.experts))
        if router != "skewed":
            raise ValueError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")
        ranks = np.arange(1, spec.experts + 1, dtype=np.float64) ** -spec.zipf_s
        p = ranks / ranks.sum()
        out = np.empty((spec.layers, spec.experts))
        for layer in range(spec.layers):
            perm = _rng(spec, f"router-permutation-{layer}").permutation(spec.experts)
            out[layer, perm] = np.log(p)
        return out

    def router(self, router: str) -> np.ndarray:
        """Router weights, shape (layers, experts, hidden)."""
        d = self.spec.hidden_size
        r = math.sqrt(COMMON**2 + 1)
        bias = self.log_popularity(router) * r / (COMMON * d)
        weights: np.ndarray = bias[..., None] * self.common + self.noise
        return weights


def routing_check(spec: Spec, router: str, tokens: int = 4096) -> dict[str, Any]:
    """Expert popularity the routers give, against ideal Plackett-Luce sampling from ``p``.

    Draws ``tokens`` random token ids, takes their embeddings plus context noise
    of 0.1 per entry (about what 42 layers of tenfold-damped outputs add), applies
    the RMS norm and each layer's router, and counts top-k choices. The ideal is
    top-k of ``log p + Gumbel noise`` over as many tokens. Per layer: the share
    of all choices that go to the ``top_k`` experts hottest by ``p`` (observed
    and ideal) and the number of distinct experts chosen.
    """
    import numpy as np

    dense = Dense.draw(spec)
    rng = _rng(spec, "routing-check")
    ids = rng.integers(0, spec.vocab_size, tokens)
    x = dense.embed[ids] + 0.1 * rng.standard_normal((tokens, spec.hidden_size))
    h = x / np.sqrt((x**2).mean(axis=1, keepdims=True))
    weights = dense.router(router)
    logp = dense.log_popularity(router)
    k = spec.top_k

    def share(scores: np.ndarray, hot: np.ndarray) -> tuple[float, int]:
        chosen = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        freq = np.bincount(chosen.ravel(), minlength=spec.experts) / chosen.size
        return float(freq[hot].sum()), int((freq > 0).sum())

    per_layer = []
    for layer in range(spec.layers):
        hot = np.argsort(-logp[layer])[:k]
        observed, distinct = share(h @ weights[layer].T, hot)
        ideal, _ = share(logp[layer] + rng.gumbel(size=(tokens, spec.experts)), hot)
        per_layer.append({
            "hot_share_observed": round(observed, 4),
            "hot_share_ideal": round(ideal, 4),
            "distinct_experts": distinct,
        })  # fmt: skip
    return {"router": router, "tokens": tokens, "top_k": k, "layers": per_layer}


# --- writing --------------------------------------------------------------------------------------


def _shards(spec: Spec) -> list[list[Part]]:
    """Parts other than routers, cut into shards of about ``spec.shard_bytes``."""
    shards: list[list[Part]] = [[]]
    size = 0
    for part in checkpoint.layout(spec):
        if part.kind == "router":
            continue
        n = part_bytes(part)
        if shards[-1] and size + n > spec.shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(part)
        size += n
    return shards


def _write_shard(
    spec: Spec, parts: Sequence[Part], path: Path, dense: dict[str, bytes]
) -> tuple[list[str], int]:
    """One shared shard (run in a worker process); returns its tensor names and data bytes."""
    items: list[tuple[str, Tensor]] = []
    for part in parts:
        if part.kind in LINEAR_KINDS:
            items += _nvfp4(spec, part)
        elif part.kind == "norm":
            ones = checkpoint.bf16([1.0] * part.shape[0])
            items.append((part.name, Tensor("BF16", part.shape, ones)))
        else:
            items.append((part.name, Tensor("BF16", part.shape, dense[part.name])))
    tmp = path.with_suffix(".tmp")
    size = checkpoint.write_safetensors(tmp, items)
    tmp.replace(path)
    return [name for name, _ in items], size


def _stamp(spec: Spec, routers: Iterable[str]) -> dict[str, Any]:
    return {"spec": dataclasses.asdict(spec), "routers": sorted(routers), "module": __name__}


SHARED_INDEX = "index.json"  # in ``shared/``: the shared shards' weight map and bytes


def write(
    out: Path,
    spec: Spec = GLM_SHAPE,
    routers: Sequence[str] = ROUTERS,
    workers: int = 0,
    echo: Any = print,
) -> dict[str, Path]:
    """Write the shared shards once and one model folder per router; return ``{router: folder}``.

    A folder whose ``spec.json`` records the same spec keeps its shared shards:
    routers it already has are kept as they are, and a router it lacks is added
    beside them (one copy of the experts per machine start, whichever routers
    each server asks for). Another spec rewrites everything.
    """
    spec.check()
    if spec.dense or spec.weights != "nvfp4":
        raise ValueError("the routed writer writes NVFP4 MoE checkpoints only")
    for router in routers:
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")
    folders = {router: out / router for router in routers}
    stamp_path, shared = out / STAMP, out / "shared"
    old = json.loads(stamp_path.read_text()) if stamp_path.exists() else None
    same_spec = (
        old is not None
        and old == _stamp(spec, old.get("routers", ()))
        and (shared / SHARED_INDEX).exists()
    )
    have = set(old["routers"]) if same_spec and old is not None else set()
    missing = [router for router in routers if router not in have]
    if not missing:
        echo(f"checkpoint in {out} is current ({STAMP}); not rewritten")
        return folders
    started = time.monotonic()
    dense = Dense.draw(spec)
    if have:
        index = json.loads((shared / SHARED_INDEX).read_text())
        weight_map, shared_bytes = index["weight_map"], index["bytes"]
        echo(f"checkpoint in {out}: shared shards current; adding routers {', '.join(missing)}")
    else:
        weight_map, shared_bytes = _write_shared(out, spec, dense, workers, echo, started)
    for router in missing:
        _write_router(folders[router], shared, spec, dense, router, weight_map, shared_bytes)
    stamp_path.write_text(json.dumps(_stamp(spec, have | set(missing)), indent=2) + "\n")
    gib = expert_bytes(spec) / 2**30
    elapsed = time.monotonic() - started
    added = ", ".join(missing)
    echo(f"checkpoint: {gib:.2f} GiB of experts, routers {added} written, {elapsed:.0f} s")
    return folders


def _write_shared(
    out: Path, spec: Spec, dense: Dense, workers: int, echo: Any, started: float
) -> tuple[dict[str, str], int]:
    """Replace every shard of ``out`` by this spec's shared shards; return their map and bytes.

    The router folders hold hard links to the shared shards, so they are
    emptied first: only then does unlinking a shard give its disk space back.
    """
    (out / STAMP).unlink(missing_ok=True)
    shared = out / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    for folder in [shared, *(out / router for router in ROUTERS)]:
        for stale in folder.glob("*.safetensors"):
            stale.unlink()
    (shared / SHARED_INDEX).unlink(missing_ok=True)
    need = expert_bytes(spec) + other_bytes(spec) + 2**30  # one GiB for routers and documents
    free = shutil.disk_usage(shared).free
    if free < need:
        raise ValueError(
            f"the checkpoint needs {need / 2**30:.1f} GiB and {shared} has {free / 2**30:.1f} GiB "
            "free: write it elsewhere (--checkpoint DIR) or use fewer experts (--experts)"
        )
    dense_bytes = {
        "model.embed_tokens.weight": _bf16(dense.embed),
        "lm_head.weight": _bf16(dense.lm_head),
    }
    shards = _shards(spec)
    weight_map: dict[str, str] = {}
    shared_bytes = 0
    done = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers or os.cpu_count()) as pool:
        futures = {
            pool.submit(
                _write_shard, spec, parts, shared / f"model-shared-{i:05d}.safetensors",
                {k: v for k, v in dense_bytes.items() if any(p.name == k for p in parts)},
            ): f"model-shared-{i:05d}.safetensors"
            for i, parts in enumerate(shards, 1)
        }  # fmt: skip
        for future in concurrent.futures.as_completed(futures):
            names, size = future.result()
            weight_map.update({name: futures[future] for name in names})
            shared_bytes += size
            done += 1
            elapsed = time.monotonic() - started
            echo(f"checkpoint: {done}/{len(shards)} shared shards ({elapsed:.0f} s)")
    index = {"weight_map": dict(sorted(weight_map.items())), "bytes": shared_bytes}
    (shared / SHARED_INDEX).write_text(json.dumps(index) + "\n")
    return weight_map, shared_bytes


def _write_router(
    folder: Path,
    shared: Path,
    spec: Spec,
    dense: Dense,
    router: str,
    weight_map: dict[str, str],
    shared_bytes: int,
) -> None:
    """One model folder: hard links to the shared shards, its router shard and documents."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.safetensors"):
        stale.unlink()
    for file in sorted(set(weight_map.values())):
        os.link(shared / file, folder / file)
    weights = dense.router(router)
    items = [
        (f"model.layers.{layer}.mlp.gate.weight",
         Tensor("BF16", (spec.experts, spec.hidden_size), _bf16(weights[layer])))
        for layer in range(spec.layers)
    ]  # fmt: skip
    router_file = f"model-router-{router}.safetensors"
    total = shared_bytes + checkpoint.write_safetensors(folder / router_file, items)
    files = {**weight_map, **{name: router_file for name, _ in items}}
    checkpoint.write_documents(folder, spec, files, total)
    (folder / "routing.json").write_text(json.dumps({
        "router": router,
        "construction": __doc__.split("**Routing is stated, not accidental.**")[1].split(
            "The two routers")[0].strip(),
        "zipf_s": spec.zipf_s if router == "skewed" else None,
        "log_popularity": dense.log_popularity(router).round(6).tolist(),
    }) + "\n")  # fmt: skip
