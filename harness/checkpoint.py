"""A small synthetic ModelOpt NVFP4 MoE checkpoint, written with the standard library only.

The end-to-end replay (:mod:`harness.replay`) needs a model that vLLM serves
through the same code path as the seeds' checkpoints (ModelOpt NVFP4 experts
behind ``--moe-backend marlin``) on hosts that cannot download one. This
module writes one: a ``Qwen3MoeForCausalLM`` (an architecture vLLM 0.33.0
registers in ``vllm/model_executor/models/registry.py``) with random weights
from a seed, laid out like a ModelOpt export:

* ``config.json`` with ``quantization_config`` (``quant_method = "modelopt"``,
  ``quant_algo = "NVFP4"``) and ``hf_quant_config.json`` (the legacy form
  vLLM's ``ModelOptNvFp4Config`` also reads); both exclude the router gates and
  ``lm_head``, which stay bf16 like in NVIDIA's exports;
* every quantized linear (q/k/v/o projections, each expert's gate/up/down
  projection) as four tensors: ``weight`` (uint8, ``[out, in/2]``, two e2m1
  values per byte), ``weight_scale`` (float8_e4m3fn, ``[out, in/16]``, only
  finite positive values), and the float32 scalars ``weight_scale_2`` and
  ``input_scale``. Tensors vLLM fuses (q/k/v into ``qkv_proj``, an expert's
  gate/up into ``w13``) share their scalars, as vLLM requires;
* ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json``;
* a byte-level BPE tokenizer (``tokenizer.json``, no merges: one token per
  byte, plus three special tokens) that ``transformers`` loads offline.

The safetensors format is simple enough to write by hand: an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape
and byte range, then the raw little-endian bytes. :func:`read_safetensors_header`
parses it back for tests.

The weights are noise: the model produces arbitrary tokens. It exists to
exercise loading, the MoE kernels, serving and the benchmarks, not accuracy.

Two variants serve as models the expert pool must refuse or leave alone
(:mod:`harness.soak`'s start-up faults): ``Spec(weights="bf16")``, the same
MoE with every linear in bf16 and no quantization config, and
``Spec(dense=True)``, a ``Qwen3ForCausalLM`` whose layers have one MLP of
``moe_intermediate_size`` in place of the experts.
"""

from __future__ import annotations

import array
import dataclasses
import json
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
DENSE_ARCHITECTURE = "Qwen3ForCausalLM"
DENSE_MODEL_TYPE = "qwen3"
WEIGHTS = ("nvfp4", "bf16")  # how the linears are stored
GROUP_SIZE = 16  # NVFP4: one e4m3 scale per 16 weights along the input dimension
EXCLUDED = ["lm_head", "model.layers.*.mlp.gate"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# safetensors dtype name -> bytes per element
DTYPE_SIZE = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4}


@dataclasses.dataclass(frozen=True)
class Spec:
    """Shape of the synthetic model. The defaults load in seconds and fit any GPU.

    Marlin's NVFP4 kernels want sizes that are multiples of 128 along K and 64
    along N, so keep ``hidden_size``, ``moe_intermediate_size`` and
    ``num_attention_heads * head_dim`` multiples of 128.
    """

    layers: int = 2
    experts: int = 8
    top_k: int = 2
    hidden_size: int = 256
    moe_intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 512
    max_position_embeddings: int = 32768
    seed: int = 0
    shard_bytes: int = 4 << 20
    zipf_s: float = 1.0  # the skewed router's exponent (harness.checkpoint_routed)
    weights: str = "nvfp4"  # one of WEIGHTS
    dense: bool = False  # one MLP per layer in place of the experts

    def check(self) -> None:
        """Raise ``ValueError`` for shapes the NVFP4 layout cannot express."""
        if self.layers < 1 or self.experts < 2 or not 1 <= self.top_k <= self.experts:
            raise ValueError("need layers >= 1, experts >= 2 and 1 <= top_k <= experts")
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 128:
                raise ValueError(f"{name} must be a multiple of 128")
        if (self.num_attention_heads * self.head_dim) % 128:
            raise ValueError("num_attention_heads * head_dim must be a multiple of 128")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}")
        if self.shard_bytes < 1:
            raise ValueError("shard_bytes must be positive")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {WEIGHTS}")


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor as safetensors stores it."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        count = 1
        for dim in self.shape:
            count *= dim
        if len(self.data) != count * DTYPE_SIZE[self.dtype]:
            raise ValueError(f"{self.dtype}{list(self.shape)}: {len(self.data)} bytes")


# --- value encodings ------------------------------------------------------------------------------


def bf16(values: list[float]) -> bytes:
    """bfloat16 little-endian bytes (float32 truncated to its upper half)."""
    raw = array.array("f", values)
    if raw.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte floats
        raise RuntimeError("array('f') is not 32-bit here")
    if struct.pack("=f", 1.0) != struct.pack("<f", 1.0):  # pragma: no cover - big-endian host
        raw.byteswap()
    src = raw.tobytes()
    out = bytearray(2 * len(values))
    out[0::2] = src[2::4]
    out[1::2] = src[3::4]
    return bytes(out)


def e4m3_value(byte: int) -> float:
    """The float8_e4m3fn value of one byte (NaN for 0x7f/0xff; the format has no inf)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return float("nan")
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def e4m3_scales(rng: random.Random, count: int) -> bytes:
    """Positive, finite e4m3 block scales between 0.5 and 1.875 (exponents 6 and 7)."""
    return bytes(((6 + rng.randrange(2)) << 3) | rng.randrange(8) for _ in range(count))


def f32_scalar(value: float) -> bytes:
    return struct.pack("<f", value)


# --- the model ------------------------------------------------------------------------------------


def config(spec: Spec) -> dict[str, Any]:
    """``config.json``, with the ModelOpt quantization block vLLM detects (NVFP4 weights)."""
    body = {
        "architectures": [DENSE_ARCHITECTURE if spec.dense else ARCHITECTURE],
        "model_type": DENSE_MODEL_TYPE if spec.dense else MODEL_TYPE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": (1 if spec.dense else 2) * spec.moe_intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "num_experts": spec.experts,
        "num_experts_per_tok": spec.top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "bos_token_id": 256,
        "eos_token_id": 256,
        "torch_dtype": "bfloat16",
    }
    if spec.dense:
        for key in ("moe_intermediate_size", "num_experts", "num_experts_per_tok",
                    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):  # fmt: skip
            del body[key]
    if spec.weights == "nvfp4":
        body["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": GROUP_SIZE,
            "ignore": list(EXCLUDED),
            "producer": {"name": "modelopt", "version": "synthetic"},
        }
    return body


def hf_quant_config() -> dict[str, Any]:
    """``hf_quant_config.json``: ModelOpt's legacy description of the same quantization."""
    return {
        "producer": {"name": "modelopt", "version": "synthetic"},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": GROUP_SIZE,
            "exclude_modules": list(EXCLUDED),
        },
    }


class _Weights:
    """Deterministic random tensors; the scalars of fused groups are shared."""

    # |w| <= 6 (largest e2m1) * 1.875 (largest block scale) * WEIGHT_SCALE_2 ~= 0.06
    WEIGHT_SCALE_2 = 0.005
    # global activation scale as ModelOpt calibrates it: amax / (6 * 448), for amax ~ 8
    INPUT_SCALE = 8.0 / (6 * 448)

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def normal(self, shape: tuple[int, ...], std: float) -> Tensor:
        count = 1
        for dim in shape:
            count *= dim
        return Tensor("BF16", shape, bf16([self.rng.gauss(0.0, std) for _ in range(count)]))

    def ones(self, size: int) -> Tensor:
        return Tensor("BF16", (size,), bf16([1.0] * size))

    def nvfp4(self, prefix: str, out: int, inp: int) -> Iterator[tuple[str, Tensor]]:
        """The four tensors of one ModelOpt NVFP4 linear layer."""
        yield f"{prefix}.weight", Tensor("U8", (out, inp // 2), self.rng.randbytes(out * inp // 2))
        scales = e4m3_scales(self.rng, out * inp // GROUP_SIZE)
        yield f"{prefix}.weight_scale", Tensor("F8_E4M3", (out, inp // GROUP_SIZE), scales)
        yield f"{prefix}.weight_scale_2", Tensor("F32", (), f32_scalar(self.WEIGHT_SCALE_2))
        yield f"{prefix}.input_scale", Tensor("F32", (), f32_scalar(self.INPUT_SCALE))


@dataclasses.dataclass(frozen=True)
class Part:
    """One entry of the checkpoint's layout, before any value is drawn.

    ``kind`` says how a writer fills it: ``embed``, ``router`` and ``lm_head``
    are bf16 matrices; ``norm`` is a bf16 vector of ones; ``linear`` (an
    attention input projection), ``linear_out`` (``o_proj``), ``expert`` (an
    expert's gate/up projection) and ``expert_out`` (its down projection) are
    NVFP4 linears of ``shape = (out, in)``, four tensors under the prefix
    ``name``. Both writers walk the same layout, so they name and shape every
    tensor alike.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    layer: int = -1


LINEAR_KINDS = ("linear", "linear_out", "expert", "expert_out")


def layout(spec: Spec) -> Iterator[Part]:
    """Every entry of the checkpoint, in a fixed order."""
    spec.check()
    h, inter = spec.hidden_size, spec.moe_intermediate_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    yield Part("model.embed_tokens.weight", "embed", (spec.vocab_size, h))
    for layer in range(spec.layers):
        p = f"model.layers.{layer}"
        yield Part(f"{p}.input_layernorm.weight", "norm", (h,), layer)
        yield Part(f"{p}.post_attention_layernorm.weight", "norm", (h,), layer)
        yield Part(f"{p}.self_attn.q_norm.weight", "norm", (spec.head_dim,), layer)
        yield Part(f"{p}.self_attn.k_norm.weight", "norm", (spec.head_dim,), layer)
        yield Part(f"{p}.self_attn.q_proj", "linear", (q_out, h), layer)
        yield Part(f"{p}.self_attn.k_proj", "linear", (kv_out, h), layer)
        yield Part(f"{p}.self_attn.v_proj", "linear", (kv_out, h), layer)
        yield Part(f"{p}.self_attn.o_proj", "linear_out", (h, q_out), layer)
        if spec.dense:
            yield Part(f"{p}.mlp.gate_proj", "linear", (inter, h), layer)
            yield Part(f"{p}.mlp.up_proj", "linear", (inter, h), layer)
            yield Part(f"{p}.mlp.down_proj", "linear_out", (h, inter), layer)
            continue
        yield Part(f"{p}.mlp.gate.weight", "router", (spec.experts, h), layer)
        for expert in range(spec.experts):
            e = f"{p}.mlp.experts.{expert}"
            yield Part(f"{e}.gate_proj", "expert", (inter, h), layer)
            yield Part(f"{e}.up_proj", "expert", (inter, h), layer)
            yield Part(f"{e}.down_proj", "expert_out", (h, inter), layer)
    yield Part("model.norm.weight", "norm", (h,))
    yield Part("lm_head.weight", "lm_head", (spec.vocab_size, h))


def tensors(spec: Spec) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of the small checkpoint, drawn in :func:`layout`'s order from one seed."""
    w = _Weights(spec.seed)
    for part in layout(spec):
        if part.kind in LINEAR_KINDS and spec.weights == "bf16":
            yield f"{part.name}.weight", w.normal(part.shape, 0.02)
        elif part.kind in LINEAR_KINDS:
            yield from w.nvfp4(part.name, *part.shape)
        elif part.kind == "norm":
            yield part.name, w.ones(part.shape[0])
        else:
            yield part.name, w.normal(part.shape, 0.02)


# --- safetensors ----------------------------------------------------------------------------------


def write_safetensors(path: Path, items: list[tuple[str, Tensor]]) -> int:
    """Write one safetensors file; return the bytes of tensor data in it."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in items:
        header[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(tensor.data)],
        }
        offset += len(tensor.data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(encoded)))
        fh.write(encoded)
        for _, tensor in items:
            fh.write(tensor.data)
    return offset


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (without ``__metadata__``), checked for holes."""
    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header: dict[str, Any] = json.loads(fh.read(size))
    header.pop("__metadata__", None)
    data_bytes = path.stat().st_size - 8 - size
    end = 0
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, stop = entry["data_offsets"]
        count = 1
        for dim in entry["shape"]:
            count *= dim
        if begin != end or stop - begin != count * DTYPE_SIZE[entry["dtype"]]:
            raise ValueError(f"{path.name}: {name} has offsets {begin}..{stop}, expected {end}")
        end = stop
    if end != data_bytes:
        raise ValueError(f"{path.name}: header covers {end} of {data_bytes} data bytes")
    return header


def read_tensor(path: Path, name: str) -> tuple[dict[str, Any], bytes]:
    """One tensor's header entry and raw bytes."""
    with path.open("rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        entry: dict[str, Any] = json.loads(fh.read(size))[name]
        begin, stop = entry["data_offsets"]
        fh.seek(8 + size + begin)
        return entry, fh.read(stop - begin)


# --- tokenizer ------------------------------------------------------------------------------------


def byte_alphabet() -> dict[int, str]:
    """The usual byte-level BPE alphabet: each byte as one printable character.

    Printable Latin-1 bytes stand for themselves; the others (control
    characters, space, and a few gaps) are moved to code points from 256 up,
    in byte order, so no byte maps to whitespace.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return alphabet


def tokenizer_files(max_length: int) -> dict[str, Any]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of a byte-level tokenizer."""
    vocab = {char: byte for byte, char in sorted(byte_alphabet().items())}
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [
        {
            "id": 256 + i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    ]
    tokenizer: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": tokenizer_config}


# --- the whole checkpoint -------------------------------------------------------------------------


def write(out: Path, spec: Spec | None = None) -> Path:
    """Write the checkpoint into ``out`` (created; existing files are replaced)."""
    spec = spec or Spec()
    spec.check()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model-*.safetensors"):
        old.unlink()
    shards: list[list[tuple[str, Tensor]]] = [[]]
    size = 0
    for name, tensor in tensors(spec):
        if shards[-1] and size + len(tensor.data) > spec.shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += len(tensor.data)
    weight_map: dict[str, str] = {}
    total = 0
    for index, items in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / file, items)
        weight_map.update({name: file for name, _ in items})
    write_documents(out, spec, weight_map, total)
    return out


def write_documents(out: Path, spec: Spec, weight_map: dict[str, str], total: int) -> None:
    """The JSON files beside the shards: configs, index and tokenizer."""
    documents: dict[str, Any] = {
        "config.json": config(spec),
        **({"hf_quant_config.json": hf_quant_config()} if spec.weights == "nvfp4" else {}),
        "generation_config.json": {"bos_token_id": 256, "eos_token_id": 256},
        "model.safetensors.index.json": {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        },
        **tokenizer_files(spec.max_position_embeddings),
    }
    for name, document in documents.items():
        (out / name).write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
