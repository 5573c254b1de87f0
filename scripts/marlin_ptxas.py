"""Registers, spills and blocks per SM of the Marlin MoE NVFP4/bf16 kernels, per build.

Usage (from the repository root, on any machine; no GPU needed)::

    PYTHONPATH=. python scripts/marlin_ptxas.py \\
        --log stock=.bundle-marlin/build-marlin_base/kernels.log \\
        --log fixed=.bundle-marlin/build-marlin_series/kernels.log --out DIR

Each log is the ``-Xptxas -v`` report of the kernel translation unit, written by
``harness.kernels.build_kernels(..., ptxas_verbose=True)`` to
``<out>/build-<namespace>/kernels.log`` (the exact nvcc command is in the
library's ``lib<namespace>.json`` manifest). For every instantiation the script
lists registers and spill bytes, and the blocks per SM that vLLM 0.33.0's
``determine_exec_config`` (csrc/moe/marlin_moe_wna16/ops.cu) derives from the
register count when the op chooses the tile itself::

    min(255 * 1024 // (regs * num_threads * 4), cap),  cap = 4 if m_blocks == 1 else 2

(before the shared-memory and problem-size limits, which do not depend on the
build). Writes ``ptxas.json`` in the harness result schema (kind ``marlin_ptxas``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from harness import results

DEVICE_MAX_REG_SIZE = 255 * 1024
_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_TEMPLATE = re.compile(
    r"MarlinILl\d+ELl\d+ELl\d+ELl\d+ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELb(\d)ELi(\d+)ELi(-?\d+)"
)
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def blocks_per_sm(regs: int, threads: int, m_blocks: int) -> int:
    """``determine_exec_config``'s register limit on blocks per SM, with its cap."""
    allow = DEVICE_MAX_REG_SIZE // (max(regs, 1) * threads * 4)
    return max(min(allow, 4 if m_blocks == 1 else 2), 1)


def parse(log: Path) -> dict[str, dict[str, Any]]:
    """Kernel label -> threads, tile, registers, spills, blocks per SM."""
    kernels: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in log.read_text(errors="replace").splitlines():
        entry = _ENTRY.search(line)
        if entry:
            match = _TEMPLATE.search(entry.group(1))
            if match is None:
                current = None
                continue
            threads, m_blocks, n_blocks, k_blocks, m8, stages, group = map(int, match.groups())
            current = {
                "threads": threads, "m_blocks": m_blocks, "thread_n": 16 * n_blocks,
                "thread_k": 16 * k_blocks, "m_block_size_8": bool(m8), "stages": stages,
                "group_blocks": group,
            }  # fmt: skip
            label = f"t{threads}_m{m_blocks}_k{16 * k_blocks}_n{16 * n_blocks}" + (
                "_m8" if m8 else ""
            )
            kernels[label] = current
            continue
        if current is None:
            continue
        spill = _SPILL.search(line)
        if spill:
            current["spill_store_bytes"] = int(spill.group(1))
            current["spill_load_bytes"] = int(spill.group(2))
        regs = _REGS.search(line)
        if regs:
            current["registers"] = int(regs.group(1))
            current["blocks_per_sm"] = blocks_per_sm(
                current["registers"], current["threads"], current["m_blocks"]
            )
    return kernels


def build_info(log: Path) -> dict[str, Any]:
    """Revision, commit, toolchain and nvcc command of the build that wrote ``log``.

    Read from the ``lib<namespace>.json`` manifest beside ``build-<namespace>/``;
    empty when there is none.
    """
    namespace = log.parent.name.removeprefix("build-")
    manifest = log.parent.parent / f"lib{namespace}.json"
    if not manifest.exists():
        return {}
    info = json.loads(manifest.read_text())
    return {
        "manifest": str(manifest),
        **{key: info.get(key) for key in ("rev", "commit", "sha256", "arch")},
        "nvcc_version": info.get("toolchain", {}).get("nvcc_version"),
        "kernel_command": info.get("commands", [[]])[0],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--log",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a build's ptxas log; the first one is the reference",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    builds = {name: Path(path) for name, path in (x.split("=", 1) for x in args.log)}
    tables = {name: parse(path) for name, path in builds.items()}
    reference = next(iter(tables))
    for name, table in tables.items():
        if set(table) != set(tables[reference]):
            raise SystemExit(f"{name}: other instantiations than {reference}")
    names = list(tables)
    print("kernel".ljust(22) + "".join(f"{n:>26}" for n in names))
    changed = []
    for label in sorted(tables[reference]):
        cells = []
        for name in names:
            k = tables[name][label]
            cells.append(
                f"{k['registers']:>4} r {k['spill_store_bytes']:>3}/"
                f"{k['spill_load_bytes']:<3} sp {k['blocks_per_sm']} bps"
            )
            if k["blocks_per_sm"] != tables[reference][label]["blocks_per_sm"]:
                changed.append(f"{name}:{label}")
        print(label.ljust(22) + "".join(f"{c:>26}" for c in cells))
    print("blocks per SM differ from " + reference + ": " + (", ".join(changed) or "none"))
    if args.out:
        data = {
            "formula": "min(255*1024 // (regs*threads*4), 4 if m_blocks == 1 else 2), >= 1",
            "reference": reference,
            "blocks_per_sm_changed": changed,
            "logs": {name: str(path) for name, path in builds.items()},
            "builds": {name: build_info(path) for name, path in builds.items()},
            "kernels": tables,
        }
        prov = results.provenance([Path(sys.executable).name, *sys.argv])
        results.write(args.out / "ptxas.json", "marlin_ptxas", data, prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
