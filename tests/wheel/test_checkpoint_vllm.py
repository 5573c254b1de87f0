"""vLLM 0.33.0 reads the synthetic checkpoint as a ModelOpt NVFP4 Qwen3-MoE model.

Runs on CPU. Two kernel choices are pinned because this host has no GPU: the
NVFP4 linear kernel (emulation) and the NVFP4 MoE backend (Marlin, what the
replay serves with). Neither changes which parameters exist or how checkpoint
names map onto them: both come from the real ``create_weights`` and
``load_weights`` code, which is what these tests check. The expert kernels are
never run (``process_weights_after_loading`` is not called).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from harness import checkpoint

SPEC = checkpoint.Spec(layers=2, experts=4, shard_bytes=1 << 20)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint.write(tmp_path_factory.mktemp("ckpt"), SPEC)


@pytest.fixture(scope="module")
def vllm_config(ckpt: Path) -> Any:
    from vllm.config import ModelConfig, VllmConfig

    model_config = ModelConfig(
        model=str(ckpt), tokenizer=str(ckpt), dtype="bfloat16", max_model_len=1024
    )
    # Only configs are built, no CPU kernel runs: vLLM 0.34.0's CPU platform
    # refuses an x86 host without triton-cpu (0.33.0 only warned).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("vllm.triton_utils.HAS_TRITON", True)
        return VllmConfig(model_config=model_config)


def test_architecture_and_quantization_are_detected(vllm_config: Any) -> None:
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    mc = vllm_config.model_config
    assert mc.architectures == [checkpoint.ARCHITECTURE]
    assert mc._model_info.architecture == checkpoint.ARCHITECTURE
    assert mc.quantization == "modelopt_fp4"
    quant = vllm_config.quant_config
    assert isinstance(quant, ModelOptNvFp4Config)
    assert quant.quant_method == "NVFP4"  # W4A4: input scales are used, not W4A16
    assert quant.is_checkpoint_nvfp4_serialized and quant.group_size == 16
    assert quant.is_layer_excluded("lm_head")
    assert quant.is_layer_excluded("model.layers.1.mlp.gate")
    assert not quant.is_layer_excluded("model.layers.1.self_attn.qkv_proj")


def test_tokenizer_loads_offline(ckpt: Path) -> None:
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(ckpt))
    ids = tokenizer.encode("Grüße, 你好")
    assert tokenizer.decode(ids) == "Grüße, 你好"
    assert len(ids) == len("Grüße, 你好".encode())
    assert tokenizer.eos_token_id == 256


def _safetensors(ckpt: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    yield from safetensors_weights_iterator(sorted(map(str, ckpt.glob("*.safetensors"))), False)


def test_every_tensor_loads_into_a_model_parameter(
    ckpt: Path, vllm_config: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.kernels import linear as linear_kernels
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.fused_moe.oracle import nvfp4 as oracle
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.platforms import PlatformEnum

    monkeypatch.setitem(
        linear_kernels._POSSIBLE_NVFP4_KERNELS, PlatformEnum.CPU, [EmulationNvFp4LinearKernel]
    )
    marlin = oracle.NvFp4MoeBackend.MARLIN
    monkeypatch.setattr(
        modelopt,
        "select_nvfp4_moe_backend",
        lambda *a, **k: (marlin, oracle.backend_to_kernel_cls(marlin)[0]),
    )
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{tmp_path / 'dist'}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        model_cls, arch = get_model_architecture(vllm_config.model_config)
        assert arch == checkpoint.ARCHITECTURE
        with torch.device("cpu"):
            model = model_cls(vllm_config=vllm_config, prefix="")
        params = dict(model.named_parameters())
        calls: collections.Counter[str] = collections.Counter()
        for name, param in params.items():
            original = getattr(param, "weight_loader", default_weight_loader)

            def counting(*args: Any, _orig: Any = original, _name: str = name, **kw: Any) -> Any:
                calls[_name] += 1
                return _orig(*args, **kw)

            param.weight_loader = counting
        loaded = model.load_weights(_safetensors(ckpt))

    n_tensors = sum(1 for _ in checkpoint.tensors(SPEC))
    # Every checkpoint tensor reached a parameter's loader: none was dropped by the
    # loader's "ignore unexpected .weight_scale/.input_scale" rules.
    assert sum(calls.values()) == n_tensors
    # Every parameter was loaded, except the attention KV-cache scales (the checkpoint
    # has no KV-cache quantization, so they keep their defaults).
    unloaded = sorted(set(params) - loaded)
    assert unloaded and all(
        n.rsplit(".", 1)[-1] in {"q_scale", "k_scale", "v_scale", "prob_scale"} for n in unloaded
    ), unloaded
    experts = model.model.layers[1].mlp.experts.routed_experts
    assert experts.w13_weight.dtype == torch.uint8
    assert experts.w13_weight_scale.dtype == torch.float8_e4m3fn
    # Expert 3's w13 is its gate_proj then its up_proj, byte for byte.
    shard = ckpt / "model.safetensors.index.json"
    assert shard.exists()
    tensors = dict(_safetensors(ckpt))
    prefix = "model.layers.1.mlp.experts.3"
    expected = torch.cat(
        [tensors[f"{prefix}.gate_proj.weight"], tensors[f"{prefix}.up_proj.weight"]]
    )
    assert torch.equal(experts.w13_weight.data[3], expected)
    assert torch.equal(
        experts.w2_weight_scale.data[3].view(torch.uint8),
        tensors[f"{prefix}.down_proj.weight_scale"].view(torch.uint8),
    )
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert torch.all(qkv.weight_scale_2.data == checkpoint._Weights.WEIGHT_SCALE_2)
    assert torch.all(experts.w13_input_scale.data == torch.tensor(checkpoint._Weights.INPUT_SCALE))
