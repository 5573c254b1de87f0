"""Registers, spills and blocks per SM of Marlin MoE kernels, stock vs fixed; SASS identity.

Usage (from the repository root, on any machine; no GPU needed)::

    PYTHONPATH=. python scripts/marlin_ptxas.py \\
        --build stock=.work/kernels/build-marlin_base \\
        --build fixed=.work/kernels/build-marlin_series \\
        [--cuobjdump PATH] --out DIR

Each build folder is what ``python -m harness kernels --ptxas-verbose`` leaves
in ``<out>/build-<namespace>/``: ``kernels.log`` (the ``-Xptxas -v`` reports of
every generated kernel unit) and ``obj/*.o``; the library's ``lib<ns>.json``
manifest beside the folder gives revision, commit, formats, instantiation
counts, size and the nvcc commands. The first build is the reference.

For every instantiation the script lists registers, spill bytes and the blocks
per SM of vLLM 0.33.0's ``determine_exec_config`` (:mod:`harness.ptxas`), and
the instantiations whose blocks per SM differ from the reference (there must be
none). Kernels only one build has (the fixed build's ``b64`` kernels) are listed
beside their 32-bit form. With a ``cuobjdump`` (Triton's package ships one), it
also compares each common instantiation's SASS, encodings included. Writes
``ptxas.json`` (kind ``marlin_ptxas``) and ``ptxas.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import ptxas, results


def manifest(build: Path) -> dict[str, Any]:
    namespace = build.name.removeprefix("build-")
    path = build.parent / f"lib{namespace}.json"
    if not path.exists():
        return {}
    info = json.loads(path.read_text())
    keys = ("rev", "commit", "sha256", "arch", "formats", "instantiations", "library_bytes")
    return {
        "manifest": str(path),
        **{key: info.get(key) for key in keys},
        "build_seconds": info.get("build_seconds"),
        "jobs": info.get("jobs"),
        "nvcc_version": info.get("toolchain", {}).get("nvcc_version"),
        "kernel_commands": [c for c in info.get("commands", []) if "-Xptxas" in c],
    }


def sass(build: Path, cuobjdump: str) -> dict[str, list[str]]:
    functions: dict[str, list[str]] = {}
    for obj in sorted((build / "obj").glob("sm*_kernel_*.o")):
        proc = subprocess.run(
            [cuobjdump, "-sass", str(obj)], capture_output=True, text=True, check=True
        )
        functions.update(ptxas.sass_functions(proc.stdout))
    return functions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    builds = {name: Path(path) for name, path in (x.split("=", 1) for x in args.build)}
    tables = {name: ptxas.parse(path / "kernels.log") for name, path in builds.items()}
    names = list(tables)
    reference = names[0]
    changed: dict[str, list[str]] = {}
    registers_changed: dict[str, list[str]] = {}
    only: dict[str, list[str]] = {}
    for name in names[1:]:
        cmp = ptxas.compare(tables[reference], tables[name])
        changed[name] = cmp.blocks_per_sm_changed()
        registers_changed[name] = cmp.registers_changed()
        only[name] = cmp.only_other
        if cmp.only_reference:
            raise SystemExit(f"{name} lacks {len(cmp.only_reference)} kernels of {reference}")

    sass_identical: dict[str, dict[str, bool]] = {}
    if args.cuobjdump:
        codes = {name: sass(path, args.cuobjdump) for name, path in builds.items()}
        for name in names[1:]:
            sass_identical[name] = ptxas.sass_differences(codes[reference], codes[name])

    header = ["kernel (types, group, threads, m_blocks, tile)"] + [
        f"{n}: regs / spill st/ld / bps" for n in names
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in ptxas.table_rows(tables)]
    table = "\n".join(lines) + "\n"
    print(table)
    for name in names[1:]:
        print(f"{name}: blocks per SM differ from {reference}: {changed[name] or 'none'}")
        print(f"{name}: registers differ from {reference}: {registers_changed[name] or 'none'}")
        print(f"{name}: kernels {reference} lacks: {len(only[name])}")
        if name in sass_identical:
            same = sum(sass_identical[name].values())
            print(f"{name}: SASS identical to {reference}: {same} of {len(sass_identical[name])}")
    if args.out:
        extra = {
            name: {
                label: {
                    "registers": tables[name][label].registers,
                    "blocks_per_sm": tables[name][label].blocks_per_sm,
                    "label_32bit": tables[name][label].label_32bit,
                    "registers_32bit": tables[name][tables[name][label].label_32bit].registers,
                    "blocks_per_sm_32bit": tables[name][
                        tables[name][label].label_32bit
                    ].blocks_per_sm,
                }
                for label in only[name]
                if tables[name][label].label_32bit in tables[name]
            }
            for name in names[1:]
        }
        data = {
            "formula": "min(255*1024 // (regs*threads*4), 4 if m_blocks == 1 else 2), >= 1",
            "reference": reference,
            "blocks_per_sm_changed": changed,
            "registers_changed": registers_changed,
            "sass_identical": {
                name: {
                    "identical": sum(v.values()),
                    "compared": len(v),
                    "differ": [k for k, ok in v.items() if not ok],
                }
                for name, v in sass_identical.items()
            },
            "extra_kernels_vs_their_32bit_form": extra,
            "builds": {name: {"dir": str(path), **manifest(path)} for name, path in builds.items()},
            "kernels": {
                name: {label: k.as_dict() for label, k in table_.items()}
                for name, table_ in tables.items()
            },
        }
        prov = results.provenance([Path(sys.executable).name, *sys.argv])
        results.write(args.out / "ptxas.json", "marlin_ptxas", data, prov)
        (args.out / "ptxas.md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
