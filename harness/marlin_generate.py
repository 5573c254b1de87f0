"""Run vLLM's Marlin MoE kernel generator restricted to a few weight formats.

Invoked by :mod:`harness.kernels` as a separate process with the Python that
owns the torch headers (the generator needs ``jinja2``, which torch brings)::

    python marlin_generate.py <generate_kernels.py> <major.minor> <out dir> [FORMAT ...]

vLLM's ``csrc/quantization/marlin/generate_kernels.py`` reads its target
architectures and output folder from ``sys.argv`` at import time and emits
about 700 (0.34.0) to 1200 (0.33.0) Marlin MoE instantiations. This wrapper
loads it by path, keeps only the entries of the requested weight formats with
16-bit activations (0.33.0 also lists 8-bit ones, 0.34.0 does not), narrows
each to the requested activation types, and lets the generator write the kernel
translation units and the matching ``kernel_selector.h``. Everything else about
an entry (tiles, group sizes, and on trees that have it the ``b_64bit_offsets``
list) is vLLM's, unchanged, and so is the kernel code.

A FORMAT is ``NAME[:ACT,...]`` with NAME one of :data:`FORMATS` and ACT
``bf16`` or ``fp16`` (default: both the entry allows), e.g. ``nvfp4:bf16`` or
``gptq4:fp16``. Without FORMAT arguments: ``nvfp4:bf16``. Standard library only.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

#: Weight format name -> (generator b_type, generator s_type or None for "same
#: as the activation").
FORMATS: dict[str, tuple[str, str | None]] = {
    "nvfp4": ("kFE2M1f", "kFE4M3fn"),
    "mxfp4": ("kFE2M1f", "kFE8M0fnu"),
    "fp8": ("kFE4M3fn", None),
    "mxfp8": ("kFE4M3fn", "kFE8M0fnu"),
    "gptq4": ("kU4B8", None),
    "awq4": ("kU4", None),
    "gptq8": ("kU8B128", None),
}

ACTIVATIONS = {"bf16": "kBFloat16", "fp16": "kFloat16"}
DEFAULT_FORMATS = ("nvfp4:bf16",)


def parse_format(spec: str) -> tuple[str, list[str] | None]:
    """``"gptq4:fp16"`` -> ``("gptq4", ["kFloat16"])``; ``"fp8"`` -> ``("fp8", None)``."""
    name, _, acts = spec.partition(":")
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(FORMATS)}")
    if not acts:
        return name, None
    out = []
    for act in acts.split(","):
        if act not in ACTIVATIONS:
            raise ValueError(f"unknown activation {act!r} in {spec!r}; known: bf16, fp16")
        out.append(ACTIVATIONS[act])
    return name, out


def select(configs: list[dict[str, Any]], specs: list[str]) -> list[dict[str, Any]]:
    """The generator entries for ``specs``, narrowed to their activation types.

    Entries with 8-bit activations (``kS8``, ``kFE4M3fn``; generators before
    vLLM 0.34.0 have them) are never kept. Raises
    ``ValueError`` when a format matches no entry or no requested activation.
    """
    selected = []
    for spec in specs:
        name, acts = parse_format(spec)
        b_type, s_type = FORMATS[name]
        matches = [
            c
            for c in configs
            if c["b_type"] == b_type
            and c.get("s_type") == s_type
            and all(a in ACTIVATIONS.values() for a in c.get("a_type", ACTIVATIONS.values()))
        ]
        if len(matches) != 1:
            raise ValueError(f"expected one generator entry for {name}, found {len(matches)}")
        config = dict(matches[0])
        allowed = list(config.get("a_type", ["kFloat16", "kBFloat16"]))
        chosen = [a for a in allowed if acts is None or a in acts]
        if not chosen:
            raise ValueError(f"{name} has no activation type among {acts} (allowed: {allowed})")
        config["a_type"] = chosen
        config["c_type"] = chosen
        selected.append(config)
    return selected


def _load(script: Path, arch: str, out_dir: Path) -> Any:
    sys.argv = [str(script), arch, str(out_dir)]
    spec = importlib.util.spec_from_file_location("vllm_marlin_generate_kernels", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {script}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    script, arch, out_dir = Path(argv[0]), argv[1], Path(argv[2])
    specs = argv[3:] or list(DEFAULT_FORMATS)
    gen = _load(script, arch, out_dir)
    try:
        gen.QUANT_CONFIGS = select(gen.QUANT_CONFIGS, specs)
    except ValueError as exc:
        print(f"{script}: {exc}", file=sys.stderr)
        return 1
    gen.remove_old_kernels()
    gen.generate_new_kernels()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
