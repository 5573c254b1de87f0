"""Do the expert pool's placement tables evolve the same way twice on one GPU?

    PYTHONPATH=.:<vllm tree> python3 scripts/pool_tables_determinism.py --out DIR \\
        [--experts 256 --rows 192]

Builds the layer stack of ``scripts/staging_replay.py`` and runs
``--rounds`` decode rounds with the LRU gate open (the same routes every
time, from one seed), snapshotting the placement tables (residency, owners,
stamps, clock) after each round; then frees everything, builds the stack
again and repeats. Tensor-parallel ranks see identical routes and must end
with identical tables (``scripts/pool_tp_replay.py`` checks that across two
GPUs); this separates the planner's own determinism from anything between
devices. Writes ``pool_tables_determinism.json`` (harness result schema).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

from staging_replay import Replay  # same folder: sys.path[0]

TABLES = ("hot_table", "owner_table", "stamp_table", "clock")


def snapshots(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Tables after each decode round of one freshly built stack."""
    import torch

    rp = Replay(args)
    out = []
    for _ in range(args.rounds):
        rp.shuffle_residency(1)
        t = rp.pool.tables
        out.append({name: getattr(t, name).cpu().reshape(-1) for name in TABLES})
    del rp
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def compare(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round, per table: entries that differ, and the first few of them."""
    rounds = []
    for a, b in zip(first, second, strict=True):
        entry: dict[str, Any] = {"identical": True}
        for name in TABLES:
            index = (a[name] != b[name]).nonzero().flatten()
            if index.numel():
                entry["identical"] = False
                entry[name] = {
                    "entries_differing": index.numel(),
                    "first": [
                        {"index": i, "runs": [int(a[name][i]), int(b[name][i])]}
                        for i in index[:8].tolist()
                    ],
                }
        rounds.append(entry)
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--rows", type=int, default=192, help="pool rows per layer")
    parser.add_argument("--layers", type=int, default=42)
    parser.add_argument("--host-sets", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch
    import vllm
    from vllm.config import VllmConfig, set_current_vllm_config

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from harness import results as harness_results

    data: dict[str, Any]
    try:
        with set_current_vllm_config(VllmConfig()):
            rounds = compare(snapshots(args), snapshots(args))
        data = {
            "rounds": rounds,
            "identical": all(r["identical"] for r in rounds),
            "setup": {**vars(args), "out": str(args.out)},
        }
    except Exception as exc:
        data = {"failed": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    prov = harness_results.provenance(
        [Path(sys.executable).name, *sys.argv],
        vllm_version=str(vllm.__version__),
        vllm_path=str(Path(vllm.__file__).parent),
        gpu_name=torch.cuda.get_device_name(),
    )
    path = harness_results.write(
        args.out / "pool_tables_determinism.json", "pool_tables_determinism", data, prov
    )
    print(f"wrote {path}")
    if "failed" in data:
        print(data["traceback"])
        return 1
    for index, entry in enumerate(data["rounds"], 1):
        detail = {k: v["entries_differing"] for k, v in entry.items() if k != "identical"}
        print(f"round {index}: {'identical' if entry['identical'] else f'differs {detail}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
