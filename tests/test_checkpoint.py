"""The synthetic ModelOpt NVFP4 checkpoint: structure checks with the standard library.

That vLLM itself reads it is tests/wheel/test_checkpoint_vllm.py (``python -m
harness selftest``, against the built wheel).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from harness import checkpoint
from harness.checkpoint import Spec

SPEC = Spec(layers=2, experts=4, shard_bytes=256 << 10)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint.write(tmp_path_factory.mktemp("ckpt"), SPEC)


def test_safetensors_header_round_trip(tmp_path: Path) -> None:
    items = [
        ("a", checkpoint.Tensor("BF16", (2, 3), checkpoint.bf16([1.0, -2.0, 0.5, 0, 3.0, 1e-3]))),
        ("b", checkpoint.Tensor("F32", (), struct.pack("<f", 0.25))),
        ("c", checkpoint.Tensor("U8", (4,), bytes([1, 2, 3, 255]))),
    ]
    path = tmp_path / "x.safetensors"
    assert checkpoint.write_safetensors(path, items) == 12 + 4 + 4
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    assert size % 8 == 0 and json.loads(raw[8 : 8 + size])["__metadata__"] == {"format": "pt"}
    header = checkpoint.read_safetensors_header(path)
    assert header["a"] == {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}
    assert header["b"] == {"dtype": "F32", "shape": [], "data_offsets": [12, 16]}
    entry, data = checkpoint.read_tensor(path, "c")
    assert entry["dtype"] == "U8" and data == bytes([1, 2, 3, 255])
    _, a = checkpoint.read_tensor(path, "a")
    # bf16 is the top half of the float32: 1.0 = 0x3f80, -2.0 = 0xc000
    assert a[:4] == bytes([0x80, 0x3F, 0x00, 0xC0])
    assert struct.unpack("<f", checkpoint.read_tensor(path, "b")[1])[0] == 0.25


def test_header_with_a_hole_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    checkpoint.write_safetensors(path, [("a", checkpoint.Tensor("U8", (4,), b"abcd"))])
    path.write_bytes(path.read_bytes() + b"extra")
    with pytest.raises(ValueError, match="covers 4 of 9"):
        checkpoint.read_safetensors_header(path)


def test_tensor_size_must_match_shape() -> None:
    with pytest.raises(ValueError, match="3 bytes"):
        checkpoint.Tensor("BF16", (2,), b"abc")


def test_shapes_and_dtypes_follow_modelopt_nvfp4(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    headers = {
        f: checkpoint.read_safetensors_header(ckpt / f) for f in set(index["weight_map"].values())
    }
    entries = {name: headers[file][name] for name, file in index["weight_map"].items()}
    h, inter = SPEC.hidden_size, SPEC.moe_intermediate_size
    e = "model.layers.1.mlp.experts.3"
    assert entries[f"{e}.gate_proj.weight"] == {
        **entries[f"{e}.gate_proj.weight"],
        "dtype": "U8",
        "shape": [inter, h // 2],
    }
    assert entries[f"{e}.down_proj.weight"]["shape"] == [h, inter // 2]
    assert entries[f"{e}.down_proj.weight_scale"]["dtype"] == "F8_E4M3"
    assert entries[f"{e}.down_proj.weight_scale"]["shape"] == [h, inter // 16]
    for scalar in ("weight_scale_2", "input_scale"):
        assert entries[f"{e}.up_proj.{scalar}"]["dtype"] == "F32"
        assert entries[f"{e}.up_proj.{scalar}"]["shape"] == []
    q = "model.layers.0.self_attn.q_proj"
    assert entries[f"{q}.weight"]["shape"] == [SPEC.num_attention_heads * SPEC.head_dim, h // 2]
    assert entries["model.layers.0.self_attn.k_proj.weight"]["shape"] == [
        SPEC.num_key_value_heads * SPEC.head_dim,
        h // 2,
    ]
    # Excluded from quantization: bf16, no scales.
    assert entries["lm_head.weight"]["dtype"] == "BF16"
    assert entries["model.layers.0.mlp.gate.weight"] == {
        **entries["model.layers.0.mlp.gate.weight"],
        "dtype": "BF16",
        "shape": [SPEC.experts, h],
    }
    assert not any(
        n.startswith(("lm_head.", "model.layers.0.mlp.gate.")) and "scale" in n for n in entries
    )
    per_layer = 4 + 4 * 4 + 1 + SPEC.experts * 3 * 4
    assert len(entries) == 3 + SPEC.layers * per_layer


def test_index_matches_the_shards(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    total = 0
    for file in files:
        header = checkpoint.read_safetensors_header(ckpt / file)
        assert {n for n, f in index["weight_map"].items() if f == file} == set(header)
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    assert index["metadata"]["total_size"] == total
    assert [n for n, _ in checkpoint.tensors(SPEC)] == [
        n
        for f in files
        for n, _ in sorted(
            checkpoint.read_safetensors_header(ckpt / f).items(),
            key=lambda kv: kv[1]["data_offsets"][0],
        )
    ]


def test_block_scales_are_finite_positive_e4m3(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    scales = [n for n in index["weight_map"] if n.endswith(".weight_scale")]
    assert scales
    seen: set[int] = set()
    for name in scales:
        entry, data = checkpoint.read_tensor(ckpt / index["weight_map"][name], name)
        assert entry["dtype"] == "F8_E4M3"
        seen |= set(data)
    assert all(b & 0x80 == 0 and b & 0x7F != 0x7F for b in seen)  # no sign bit, no NaN
    values = [checkpoint.e4m3_value(b) for b in seen]
    assert all(0.5 <= v <= 1.875 for v in values) and len(seen) == 16


def test_e4m3_decoding() -> None:
    assert checkpoint.e4m3_value(0x38) == 1.0
    assert checkpoint.e4m3_value(0x7E) == 448.0
    assert checkpoint.e4m3_value(0xB8) == -1.0
    assert checkpoint.e4m3_value(0x01) == 2.0**-9
    assert math.isnan(checkpoint.e4m3_value(0x7F)) and math.isnan(checkpoint.e4m3_value(0xFF))


def test_fused_groups_share_their_scalars(ckpt: Path) -> None:
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())

    def scalar(name: str) -> float:
        return float(
            struct.unpack("<f", checkpoint.read_tensor(ckpt / index["weight_map"][name], name)[1])[
                0
            ]
        )

    attn = "model.layers.0.self_attn"
    for s in ("weight_scale_2", "input_scale"):
        assert len({scalar(f"{attn}.{p}_proj.{s}") for p in "qkv"}) == 1
        e = "model.layers.1.mlp.experts.2"
        assert scalar(f"{e}.gate_proj.{s}") == scalar(f"{e}.up_proj.{s}") > 0


def test_configs_declare_modelopt_nvfp4(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["num_experts"] == SPEC.experts and config["num_hidden_layers"] == SPEC.layers
    q = config["quantization_config"]
    assert (q["quant_method"], q["quant_algo"], q["group_size"]) == ("modelopt", "NVFP4", 16)
    legacy = json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert legacy["quant_algo"] == "NVFP4" and legacy["exclude_modules"] == q["ignore"]
    assert {"kv_cache_quant_algo", "group_size", "exclude_modules"} <= set(legacy)


def test_tokenizer_is_byte_level_and_fits_the_vocab(ckpt: Path) -> None:
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256)) and tok["model"]["merges"] == []
    assert all(not c.isspace() and c.isprintable() for c in vocab)
    specials = [t["id"] for t in tok["added_tokens"]]
    assert max(specials) < json.loads((ckpt / "config.json").read_text())["vocab_size"]
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and "chat_template" in cfg


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    small = Spec(layers=1, experts=2, shard_bytes=1 << 30)
    a = checkpoint.write(tmp_path / "a", small)
    b = checkpoint.write(tmp_path / "b", small)
    c = checkpoint.write(tmp_path / "c", Spec(layers=1, experts=2, shard_bytes=1 << 30, seed=1))
    name = "model-00001-of-00001.safetensors"
    assert (a / name).read_bytes() == (b / name).read_bytes() != (c / name).read_bytes()


def test_invalid_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        Spec(hidden_size=200).check()
    with pytest.raises(ValueError, match="top_k"):
        Spec(experts=2, top_k=3).check()


def test_the_bf16_and_dense_variants_are_models_the_pool_must_not_take(tmp_path: Path) -> None:
    bf16 = checkpoint.write(tmp_path / "bf16", checkpoint.Spec(weights="bf16"))
    dense = checkpoint.write(tmp_path / "dense", checkpoint.Spec(dense=True))
    for folder in (bf16, dense):
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        headers = {}
        for shard in set(index.values()):
            headers.update(checkpoint.read_safetensors_header(folder / shard))
        headers.pop("__metadata__", None)
        assert set(headers) == set(index)
        names = set(index)
        if folder == bf16:
            config = json.loads((folder / "config.json").read_text())
            assert "quantization_config" not in config and config["num_experts"] == 8
            assert not (folder / "hf_quant_config.json").exists()
            assert {h["dtype"] for h in headers.values()} == {"BF16"}
            assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
        else:
            config = json.loads((folder / "config.json").read_text())
            assert config["architectures"] == ["Qwen3ForCausalLM"]
            assert "num_experts" not in config and config["intermediate_size"] == 256
            assert not any(".experts." in n or n.endswith("mlp.gate.weight") for n in names)
            assert headers["model.layers.1.mlp.down_proj.weight"]["shape"] == [256, 128]
            assert (folder / "hf_quant_config.json").exists()
    with pytest.raises(ValueError, match="weights must be one of"):
        checkpoint.Spec(weights="fp8").check()
