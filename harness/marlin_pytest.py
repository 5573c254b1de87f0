"""pytest plugin: run vLLM's own Marlin MoE tests against a standalone kernel build.

vLLM's ``tests/kernels/moe/test_moe.py`` calls ``fused_marlin_moe``, which
reaches ``torch.ops._moe_C.moe_wna16_marlin_gemm`` of the installed vLLM. With
this plugin (``pytest -p harness.marlin_pytest``) and::

    VLLM_TEST_MARLIN_MOE_LIB=/path/lib<ns>.so:<ns>
    VLLM_TEST_MARLIN_MOE_FORMATS="nvfp4:bf16,fp16 fp8:fp16 ..."   (optional)

``torch.ops._moe_C.moe_wna16_marlin_gemm`` is replaced, for the session, by a
function that forwards every argument unchanged to
``torch.ops.<ns>.moe_wna16_marlin_gemm`` of the standalone library built by
``python -m harness kernels`` (vLLM calls the op only through that attribute,
in ``vllm/_custom_ops.py``); every other op (routing, activations, repack)
stays vLLM's. Nothing in vLLM's tree changes.

A standalone build holds only some weight formats
(:data:`harness.kernels.DEFAULT_FORMATS`). When ``VLLM_TEST_MARLIN_MOE_FORMATS``
lists them (the ``--format`` values of the build), Marlin test cases of other
formats or activation types are skipped with a reason naming what is missing,
instead of failing on a missing kernel. Each test records in its JUnit
properties how many GEMM calls went to the standalone library
(``marlin_lib_calls``), and the terminal summary gives the total, so a run in
which the replacement did not take effect is visible. Without
``VLLM_TEST_MARLIN_MOE_LIB`` the plugin does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

from harness.ptxas import type_name

LIB_ENV = "VLLM_TEST_MARLIN_MOE_LIB"
FORMATS_ENV = "VLLM_TEST_MARLIN_MOE_FORMATS"
OP = "moe_wna16_marlin_gemm"

_state: dict[str, Any] = {"calls": 0, "library": None, "spec": None}

_ACTIVATIONS = {"f16": "fp16", "bf16": "bf16", "s8": "s8", "fe4m3fn": "fp8"}


def built_formats(text: str) -> set[tuple[str, str]]:
    """``"nvfp4:bf16,fp16 fp8:fp16"`` -> ``{("nvfp4", "bf16"), ("nvfp4", "fp16"), ...}``.

    A format without activations counts for bf16 and fp16.
    """
    out = set()
    for spec in text.split():
        name, _, acts = spec.partition(":")
        for act in acts.split(",") if acts else ["bf16", "fp16"]:
            out.add((name, act))
    return out


def _name(scalar_type: Any) -> str:
    """Short name (:func:`harness.ptxas.type_name`) of a vLLM ScalarType."""
    return type_name(int(scalar_type.id))


def weight_format(b_type: str, group_blocks: int | None) -> str:
    """harness format name of a weight type's short name (``fe2m1f``, ``u4b8``...)."""
    if b_type == "fe2m1f":
        return "mxfp4" if group_blocks == 2 else "nvfp4"
    if b_type == "fe4m3fn":
        return "mxfp8" if group_blocks == 2 else "fp8"
    return {"u4b8": "gptq4", "u4": "awq4", "u8b128": "gptq8"}.get(b_type, b_type)


def case_format(name: str, params: dict[str, Any]) -> tuple[str, str] | None:
    """(weight format, activation) of one vLLM Marlin MoE test case, if known.

    Covers ``test_fused_marlin_moe`` (its parameters), the fixed formats of
    ``test_fused_marlin_moe_with_bias`` (GPTQ int4, fp16) and
    ``test_fused_marlin_moe_non_gated`` (NVFP4, bf16), and
    ``test_batched_fused_marlin_moe`` (its parameters).
    """
    base = name.split("[", 1)[0]
    if base == "test_fused_marlin_moe" and "b_type" in params:
        a_type = _name(params["a_type"])
        return weight_format(_name(params["b_type"]), params.get("group_blocks")), _ACTIVATIONS.get(
            a_type, a_type
        )
    if base == "test_fused_marlin_moe_with_bias":
        return "gptq4", "fp16"
    if base == "test_fused_marlin_moe_non_gated":
        return "nvfp4", "bf16"
    if base == "test_batched_fused_marlin_moe" and "quant_dtype" in params:
        input_type = params.get("input_type")
        if input_type is not None:
            act = _ACTIVATIONS.get(_name(input_type), _name(input_type))
        else:
            act = "bf16" if "bfloat16" in str(params.get("dtype")) else "fp16"
        b_type = _name(params["quant_dtype"])
        return weight_format(b_type, 2 if b_type == "fe2m1f" else None), act
    return None


def _install(spec: str) -> None:
    import torch
    import vllm._custom_ops  # noqa: F401  (loads _C and _moe_C)

    path, sep, namespace = spec.rpartition(":")
    if not sep or not path or not namespace:
        raise pytest.UsageError(f"{LIB_ENV} must look like /path/lib<ns>.so:<ns>, not {spec!r}")
    torch.ops.load_library(path)
    target = getattr(getattr(torch.ops, namespace), OP)

    def forward(*args: Any, **kwargs: Any) -> Any:
        _state["calls"] += 1
        return target(*args, **kwargs)

    # vLLM reaches the op only as torch.ops._moe_C.moe_wna16_marlin_gemm
    # (vllm/_custom_ops.py), an attribute lookup on the namespace object.
    setattr(torch.ops._moe_C, OP, forward)
    _state.update(library=target, spec=spec)


def pytest_configure(config: pytest.Config) -> None:
    spec = os.environ.get(LIB_ENV)
    if spec:
        _install(spec)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    formats = os.environ.get(FORMATS_ENV)
    if not _state["spec"] or not formats:
        return
    built = built_formats(formats)
    for item in items:
        callspec = getattr(item, "callspec", None)
        fmt = case_format(item.name, dict(callspec.params) if callspec else {})
        if fmt is not None and fmt not in built:
            item.add_marker(
                pytest.mark.skip(
                    reason=(
                        f"{fmt[0]} weights with {fmt[1]} activations are not in the "
                        f"standalone Marlin MoE build {_state['spec']} (built: {formats})"
                    )
                )
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    before = _state["calls"]
    yield
    if _state["spec"]:
        item.user_properties.append(("marlin_lib_calls", _state["calls"] - before))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _state["spec"]:
        terminalreporter.write_line(
            f"marlin_pytest: {_state['calls']} moe_wna16_marlin_gemm calls went to {_state['spec']}"
        )
