"""Replay the 32 GiB weight-offset bound of Marlin MoE on stock and fixed kernels.

Usage (from the repository root)::

    PYTHONPATH=. python scripts/marlin_bound.py --lib stock=PATH:NS \\
        --lib fixed=PATH:NS [--rows 8192 8193 12000 16385] --out DIR

Bank: w13 of NVFP4 experts with hidden 4096 and intermediate 1024, i.e. Marlin
rows of (256, 4096) int32 = 4 MiB (2^18 int4) plus 512 KiB of scales. One real
expert sits at row 0. Every (library, rows) case runs in its own process, since
an illegal memory access poisons the CUDA context. Steps of a case:

1. ``row0``: 8 tokens routed to row 0 (the reference output);
2. ``last``: the same expert copied to the last row, same tokens -> must equal
   ``row0`` bitwise;
3. ``mixed``: one launch routing 8 tokens to row 0 and 8 to the last row
   (exercises the kernel's expert-change path) -> both halves equal ``row0``;
4. ``zeroed``: the last row's weights zeroed (scales kept) -> must be all
   zeros. A 32-bit offset that wraps onto a real row reads it instead.

Outcome per case: ``identical`` (all checks hold), ``illegal memory access``,
``silently wrong`` (a check fails without an error), or ``error``. Writes
``bound.json`` to DIR in the harness result schema (kind ``marlin_bound``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

K, N, TOKENS = 4096, 2048, 8
ROW_MIB = 4 + 0.5


def _emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def run_case(spec: str, rows: int) -> int:
    """Child process: one library, one bank size; prints one JSON line per step."""
    import marlin_nvfp4 as m
    import torch

    ops = m.Lib.parse(spec).load()
    expert = m.make_expert(ops, N, K, seed=0)
    qweight = torch.zeros((rows, K // 16, 2 * N), dtype=torch.int32, device="cuda")
    scales = torch.zeros((rows, K // 16, N), dtype=torch.float8_e4m3fn, device="cuda")
    gscale = torch.ones(rows, dtype=torch.float32, device="cuda")
    last = rows - 1
    for row in (0, last):
        qweight[row] = expert.qweight
        scales[row] = expert.scales
        gscale[row] = expert.global_scale
    ws = m.workspace()
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(TOKENS, K, generator=gen) * 0.1).to(torch.bfloat16).cuda()
    one = torch.zeros((TOKENS, 1), dtype=torch.long)

    def launch(name: str, xs: torch.Tensor, ids: torch.Tensor, rows_: list[int]) -> Any:
        try:
            out = m.gemm(
                ops,
                xs,
                qweight,
                scales,
                gscale,
                m.route(ids, rows_, 8),
                ws,
                thread_k=128,
                thread_n=128,
            )
            torch.cuda.synchronize()
        except Exception as exc:  # CUDA errors surface here, at the sync
            _emit(step=name, ok=False, error=str(exc).splitlines()[0][:300])
            sys.exit(3)
        return out

    def digest(t: Any) -> str:
        return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy()).hexdigest()[:16]

    out0 = launch("row0", x, one, [0])
    ref = x.float().cpu() @ expert.weight.T
    err = (out0.float().cpu() - ref).abs().max().item()
    _emit(
        step="row0",
        ok=err <= 1e-2 * ref.abs().max().item(),
        sha256=digest(out0),
        max_abs_err_vs_dequant=err,
        ref_max_abs=ref.abs().max().item(),
    )
    out = launch("last", x, one, [last])
    _emit(step="last", ok=torch.equal(out, out0), sha256=digest(out), row=last)
    both = torch.arange(2).repeat_interleave(TOKENS).unsqueeze(1)
    out = launch("mixed", x.repeat(2, 1), both, [0, last])
    _emit(step="mixed", ok=torch.equal(out, torch.cat([out0, out0])), sha256=digest(out))
    qweight[last].zero_()
    out = launch("zeroed", x, one, [last])
    _emit(
        step="zeroed",
        ok=not bool(out.any()),
        sha256=digest(out),
        equals_row0=torch.equal(out, out0),
        max_abs=out.float().abs().max().item(),
    )
    return 0


def classify(returncode: int, steps: list[dict[str, Any]], stderr: str) -> str:
    text = stderr + " ".join(str(s.get("error", "")) for s in steps)
    if "illegal memory access" in text:
        return "illegal memory access"
    if returncode == 0 and len(steps) == 4 and all(s["ok"] for s in steps):
        return "identical"
    if returncode == 0 and len(steps) == 4:
        return "silently wrong"
    return "error"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lib", action="append", default=[], metavar="NAME=PATH:NS")
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 8193, 12000, 16385])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--timeout", type=int, default=300)
    parser.add_argument("--case", metavar="PATH:NS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        return run_case(args.case, args.rows[0])

    import marlin_nvfp4 as m

    from harness import results

    libs = {n: m.Lib.parse(s) for n, s in (x.split("=", 1) for x in args.lib)}
    cases = []
    for rows in args.rows:
        for name, lib in libs.items():
            started = time.monotonic()
            cmd = [sys.executable, __file__, "--case", lib.spec, "--rows", str(rows)]
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, check=False, timeout=args.timeout
                )
                rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
            except subprocess.TimeoutExpired as exc:
                rc, stdout, stderr = -1, str(exc.stdout or ""), "timeout"
            steps = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
            case = {
                "lib": name,
                "rows": rows,
                "bank_gib": round(rows * ROW_MIB / 1024, 3),
                "last_row_offset_int4": (rows - 1) * (1 << 18),
                "outcome": classify(rc, steps, stderr),
                "returncode": rc,
                "steps": steps,
                "stderr_tail": stderr[-600:],
                "seconds": round(time.monotonic() - started, 1),
            }
            cases.append(case)
            print(f"{name:6} rows={rows:6} -> {case['outcome']}", flush=True)
    if args.out:
        results.write(args.out / "bound.json", "marlin_bound", {"cases": cases}, m.provenance(libs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
