"""CPU tests of the Marlin helpers: the generator's format filter and the pytest plugin."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from harness import marlin_generate, marlin_pytest

# A copy of the shape of vLLM 0.33.0's generator entries (generate_kernels.py).
CONFIGS: list[dict[str, Any]] = [
    {"b_type": "kU4", "group_blocks": [-1, 2, 4, 8]},
    {"b_type": "kU4B8", "group_blocks": [-1, 2, 4, 8]},
    {"b_type": "kFE4M3fn", "group_blocks": [-1, 8]},
    {
        "b_type": "kFE2M1f",
        "s_type": "kFE4M3fn",
        "group_blocks": [1],
        "b_64bit_offsets": [False, True],
    },
    {"a_type": ["kBFloat16"], "b_type": "kFE2M1f", "s_type": "kFE8M0fnu", "group_blocks": [2]},
    {"a_type": ["kS8"], "b_type": "kU4B8", "group_blocks": [-1]},
    {"a_type": ["kFE4M3fn"], "b_type": "kU4B8", "group_blocks": [-1]},
]


def test_select_narrows_activations_and_keeps_the_rest() -> None:
    out = marlin_generate.select(CONFIGS, ["nvfp4:bf16", "gptq4:fp16", "mxfp4", "fp8"])
    assert [(c["b_type"], c["a_type"], c["c_type"]) for c in out] == [
        ("kFE2M1f", ["kBFloat16"], ["kBFloat16"]),
        ("kU4B8", ["kFloat16"], ["kFloat16"]),
        ("kFE2M1f", ["kBFloat16"], ["kBFloat16"]),
        ("kFE4M3fn", ["kFloat16", "kBFloat16"], ["kFloat16", "kBFloat16"]),
    ]
    assert out[0]["b_64bit_offsets"] == [False, True]  # the tree's own list, unchanged
    assert out[1]["group_blocks"] == [-1, 2, 4, 8]


@pytest.mark.parametrize(
    ("spec", "message"),
    [("int3", "unknown weight format"), ("nvfp4:fp32", "unknown activation"),
     ("mxfp4:fp16", "no activation type"), ("gptq8", "expected one generator entry")],
)  # fmt: skip
def test_select_refuses(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        marlin_generate.select(CONFIGS, [spec])


def _st(type_id: int) -> Any:
    return SimpleNamespace(id=type_id)


F16, BF16, S8 = 1125899906910725, 1125899906909960, 1125899906909952
FE2M1F, FE4M3FN, U4B8, U4, U8B128 = (
    562949953487106,
    2814749767172868,
    1125899907892224,
    1125899906843648,
    1125899923621888,
)


def test_built_formats() -> None:
    assert marlin_pytest.built_formats("nvfp4:bf16,fp16 fp8:fp16 mxfp4") == {
        ("nvfp4", "bf16"),
        ("nvfp4", "fp16"),
        ("fp8", "fp16"),
        ("mxfp4", "bf16"),
        ("mxfp4", "fp16"),
    }


FUSED = "test_fused_marlin_moe[x]"
BATCHED = "test_batched_fused_marlin_moe[m]"


def _fused(a: int, b: int, group: int) -> dict[str, Any]:
    return {"a_type": _st(a), "b_type": _st(b), "group_blocks": group}


def _batched(b: int, dtype: str, input_type: int | None) -> dict[str, Any]:
    return {
        "quant_dtype": _st(b),
        "dtype": dtype,
        "input_type": None if input_type is None else _st(input_type),
    }


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        (FUSED, _fused(F16, FE2M1F, 1), ("nvfp4", "fp16")),
        (FUSED, _fused(BF16, FE2M1F, 2), ("mxfp4", "bf16")),
        (FUSED, _fused(F16, FE4M3FN, -1), ("fp8", "fp16")),
        (FUSED, _fused(S8, U4, 8), ("awq4", "s8")),
        (FUSED, _fused(F16, U8B128, 2), ("gptq8", "fp16")),
        ("test_fused_marlin_moe_with_bias[1]", {"m": 1}, ("gptq4", "fp16")),
        ("test_fused_marlin_moe_non_gated[a]", {}, ("nvfp4", "bf16")),
        (BATCHED, _batched(FE2M1F, "torch.bfloat16", None), ("mxfp4", "bf16")),
        (BATCHED, _batched(U4, "torch.float16", S8), ("awq4", "s8")),
        ("test_fused_moe[x]", {}, None),
        ("test_gptq", {"b_type": _st(U4B8)}, None),
    ],
)
def test_case_format(name: str, params: dict[str, Any], expected: tuple[str, str] | None) -> None:
    assert marlin_pytest.case_format(name, params) == expected
