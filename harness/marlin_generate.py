"""Run vLLM's Marlin kernel generator restricted to NVFP4 weights, bf16 in and out.

Invoked by :mod:`harness.kernels` as a separate process with the Python that
owns the torch headers (the generator needs ``jinja2``, which torch brings)::

    python marlin_generate.py <generate_kernels.py> <major.minor> <out dir>

vLLM's ``csrc/quantization/marlin/generate_kernels.py`` reads its target
architectures and output folder from ``sys.argv`` at import time and emits
about 1200 Marlin MoE instantiations. This wrapper loads it by path, keeps only
its NVFP4 entry (``kFE2M1f`` weights with ``kFE4M3fn`` group scales), narrows
that entry to bf16 activations and outputs, and lets the generator write the
kernel translation unit and the matching ``kernel_selector.h``. The kernel
code itself is vLLM's, unchanged. Standard library only.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def _load(script: Path, arch: str, out_dir: Path) -> Any:
    sys.argv = [str(script), arch, str(out_dir)]
    spec = importlib.util.spec_from_file_location("vllm_marlin_generate_kernels", script)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {script}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    script, arch, out_dir = Path(argv[0]), argv[1], Path(argv[2])
    gen = _load(script, arch, out_dir)
    nvfp4 = [
        c for c in gen.QUANT_CONFIGS if c["b_type"] == "kFE2M1f" and c.get("s_type") == "kFE4M3fn"
    ]
    if len(nvfp4) != 1:
        print(f"expected one NVFP4 config in {script}, found {len(nvfp4)}", file=sys.stderr)
        return 1
    config = dict(nvfp4[0], a_type=["kBFloat16"], c_type=["kBFloat16"])
    gen.QUANT_CONFIGS = [config]
    gen.remove_old_kernels()
    gen.generate_new_kernels()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
