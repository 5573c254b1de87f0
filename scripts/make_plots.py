"""Draw results/plots/*.png from the layer-level result files.

    PYTHONPATH=. python3 scripts/make_plots.py [--out results/plots]

Three pictures, each read from a committed result file (no number is typed in
here): MoE-only TTFT by staging mode and prompt length
(results/staging/staging_replay_run3.json), the Marlin bound by bank rows
(results/marlin/run1_bound.json and run3_bound.json), and allocated memory by
MoE layer for one B12x wrapper per layer against one shared wrapper
(results/b12x/b12x_oom_replay_h200.json). Each PNG's title names its file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STAGING = "results/staging/staging_replay_run3.json"
BOUND = ("results/marlin/run1_bound.json", "results/marlin/run3_bound.json")
B12X = "results/b12x/b12x_oom_replay_h200.json"
GIB = 1 << 30


def _data(rel: str) -> Any:
    return json.loads((ROOT / rel).read_text())["data"]


def ttft(ax: Any) -> None:
    run = _data(STAGING)
    data, setup = run["ttft_moe_only"], run["setup"]
    modes = [("host_view", "host view"), ("staged_sync", "staged, no prefetch"),
             ("staged", "staged + prefetch")]  # fmt: skip
    steps = sorted({int(k.split("_")[-2]) for k in data})
    prompts = ["12.5K", "81.6K"]
    width = 0.8 / len(modes)
    labels = [f"{p}\n{s}-token steps" for p in prompts for s in steps]
    for i, (key, name) in enumerate(modes):
        values = [data[f"{key}_{s}_{p}"]["seconds"] for p in prompts for s in steps]
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width for x in range(len(labels))], labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("MoE-only TTFT (s)")
    shape = f"{setup['layers']} layers x {setup['experts']} experts"
    ax.set_title(f"Prefill staging, {shape}, H200\n{STAGING}", fontsize=8)
    ax.legend(fontsize=7)


def bound(ax: Any) -> None:
    cases = [c for rel in BOUND for c in _data(rel)["cases"]]
    seen: dict[tuple[str, int], str] = {}
    for case in cases:
        lib = "stock" if case["lib"] == "stock" else "with 0006"
        seen[(lib, case["rows"])] = case["outcome"]
    rows = sorted({r for _, r in seen})
    colors = {"identical": "tab:green", "illegal memory access": "tab:red",
              "silently wrong": "tab:orange"}  # fmt: skip
    for y, lib in enumerate(("stock", "with 0006")):
        for x, r in enumerate(rows):
            outcome = seen.get((lib, r))
            if outcome:
                ax.scatter(x, y, s=600, color=colors.get(outcome, "gray"), marker="s")
                ax.annotate(outcome, (x, y - 0.3), ha="center", fontsize=6)
    ax.set_xticks(range(len(rows)), [f"{r} rows\n{r * 4 / 1024:.1f} GiB" for r in rows])
    ax.set_yticks([0, 1], ["stock v0.33.0", "with 0006"])
    ax.set_ylim(-0.7, 1.5)
    ax.set_title("Marlin MoE, one NVFP4 expert at the last row (w13, 4 MiB rows)\n"
                 + " ".join(BOUND), fontsize=8)  # fmt: skip


def b12x(ax: Any) -> None:
    for result in _data(B12X)["results"]:
        if not result["case"].startswith("A_rtx5090"):
            continue
        layers = [p["layer"] + 1 for p in result["per_layer"]]
        gib = [p["max_allocated"] / GIB for p in result["per_layer"]]
        label = "one wrapper per layer (stock)" if result["mode"] == "stock" else "shared (0005)"
        ax.plot(layers, gib, marker=".", label=label)
        if result.get("oom_at_layer") is not None:
            ax.axvline(result["oom_at_layer"] + 1, color="tab:red", linestyle=":", linewidth=1)
        budget = result["budget_gib"]
    ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"{budget} GiB budget")
    ax.set_xlabel("MoE layers built")
    ax.set_ylabel("allocated (GiB)")
    ax.set_title(f"B12x workspaces, Qwen3.6-35B-A3B geometry, T=8192 (allocation-size replay)\n"
                 f"{B12X}", fontsize=8)  # fmt: skip
    ax.legend(fontsize=7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "plots")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in (("ttft_by_staging_mode", ttft), ("marlin_bound", bound),
                       ("b12x_memory_by_layer", b12x)):  # fmt: skip
        fig, ax = plt.subplots(figsize=(8, 4.5))
        draw(ax)
        fig.tight_layout()
        fig.savefig(args.out / f"{name}.png", dpi=110)
        plt.close(fig)
        print(args.out / f"{name}.png")


if __name__ == "__main__":
    main()
