"""Does a flashinfer-python wheel have the B12xMoEWrapper signature 0005 calls?

Reads ``flashinfer/fused_moe/cute_dsl/b12x_moe.py`` out of each wheel (no
install, no import) and checks that ``B12xMoEWrapper.__init__`` and ``run``
accept every keyword the patched ``FlashInferB12xExperts`` passes and that
nothing they require is left out.

    pip download --no-deps flashinfer-python==0.7.2.post1 -d /tmp/fi
    python scripts/b12x_flashinfer_signature.py /tmp/fi/*.whl
"""

from __future__ import annotations

import ast
import sys
import zipfile

MEMBER = "flashinfer/fused_moe/cute_dsl/b12x_moe.py"
# What the patched vLLM passes (B12xWrapperKey.wrapper_kwargs() and apply()).
INIT_KWARGS = {
    "num_experts",
    "top_k",
    "hidden_size",
    "intermediate_size",
    "max_num_tokens",
    "num_local_experts",
    "output_dtype",
    "device",
    "activation",
    "quant_mode",
    "source_format",
    "use_cuda_graph",
}
RUN_KWARGS = {
    "x",
    "w1_weight",
    "w1_weight_sf",
    "w1_alpha",
    "fc2_input_scale",
    "w2_weight",
    "w2_weight_sf",
    "w2_alpha",
    "token_selected_experts",
    "token_final_scales",
    "input_global_scale",
}


def params(fn: ast.FunctionDef) -> tuple[set[str], set[str]]:
    a = fn.args
    names = [x.arg for x in a.args[1:]]
    required = set(names[: len(names) - len(a.defaults)])
    required |= {k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None}
    return set(names) | {k.arg for k in a.kwonlyargs}, required


def check(wheel: str) -> bool:
    with zipfile.ZipFile(wheel) as z:
        try:
            src = z.read(MEMBER).decode()
        except KeyError:
            print(f"{wheel}: no {MEMBER}")
            return False
    cls = next(
        (
            n
            for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.ClassDef) and n.name == "B12xMoEWrapper"
        ),
        None,
    )
    if cls is None:
        print(f"{wheel}: no B12xMoEWrapper")
        return False
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    ok = True
    for name, passed in (("__init__", INIT_KWARGS), ("run", RUN_KWARGS)):
        accepted, required = params(methods[name])
        unknown, missing = passed - accepted, required - passed
        ok &= not unknown and not missing
        print(
            f"{wheel}: {name}: unknown {sorted(unknown) or 'none'}, "
            f"missing {sorted(missing) or 'none'}, "
            f"not passed {sorted(accepted - passed)}"
        )
    print(f"{wheel}: {'OK' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if all([check(w) for w in sys.argv[1:]]) else 1)
