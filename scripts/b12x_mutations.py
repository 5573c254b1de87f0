"""Mutation run for 0005's registry key, capacity rule and lifetime handling.

Each mutation edits one spot of the patched modules in a hard-linked copy of
the installed vLLM package (the edited file is replaced, never written
through the link), runs the CPU tests of 0005 from the patched tree against
that copy, and records the first test that fails. A mutation no test catches
is reported as "survived".

    python scripts/b12x_mutations.py --in-process \
        --python .work/venv/bin/python --tree .work/vllm --out /tmp/mutations.json

Prints a Markdown table; ``--out`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODULE = "vllm/model_executor/layers/fused_moe/experts/flashinfer_b12x_moe.py"
UTILS = "vllm/model_executor/layers/fused_moe/utils.py"
TESTS = [
    "tests/kernels/moe/test_flashinfer_b12x_workspace_sharing.py",
    # Builds FlashInfer's real wrapper on the CPU (needs flashinfer installed).
    "tests/kernels/moe/test_flashinfer_b12x_wrapper_memory.py",
]

KEY_FIELDS = [
    ("num_experts", "int"),
    ("top_k", "int"),
    ("hidden_size", "int"),
    ("intermediate_size", "int"),
    ("max_num_tokens", "int"),
    ("num_local_experts", "int"),
    ("output_dtype", "torch.dtype"),
    ("device", "torch.device"),
    ("activation", "str"),
    ("quant_mode", "str | None"),
    ("source_format", "str"),
]

ACQUIRE = """        self._wrapper: Any = _B12X_WRAPPERS.acquire(
            get_current_vllm_config_or_none(),
            self._wrapper_key,
            self._build_wrapper,
        )"""


def mutations() -> list[tuple[str, str, str, list[tuple[str, str]]]]:
    """(id, description, file, [(old, new), ...])."""
    # The baseline: no edit, every test must pass ("survived").
    rows = [("B0", "none (baseline)", MODULE, [])]
    for i, (name, typ) in enumerate(KEY_FIELDS, 1):
        rows.append(
            (
                f"K{i}",
                f"`{name}` dropped from the key (`field(compare=False)`)",
                MODULE,
                [
                    (
                        "from dataclasses import dataclass, fields",
                        "from dataclasses import dataclass, field, fields",
                    ),
                    (f"\n    {name}: {typ}\n", f"\n    {name}: {typ} = field(compare=False)\n"),
                ],
            )
        )
    # One mutation per entry, kept on as few lines as it takes to read.
    # fmt: off
    rows += [
        ("K12", "owner dropped from the key (one registry for all configs)", MODULE,
         [("        owner_id = id(owner)\n", "        owner_id = 0\n")]),
        ("C1", "capacity without the DP factor", MODULE,
         [("fi_moe_largest_bucket(moe_config, min_num_tokens=0)", "moe_config.max_num_tokens")]),
        ("C2", "capacity with the 8192 autotune floor", MODULE,
         [("fi_moe_largest_bucket(moe_config, min_num_tokens=0)", "fi_moe_largest_bucket(moe_config)")]),  # noqa: E501 (one mutation per entry)
        ("C3", "helper ignores `min_num_tokens` (always 8192)", UTILS,
         [("max(moe_config.max_num_tokens * dp_size, min_num_tokens)",
           "max(moe_config.max_num_tokens * dp_size, 8192)")]),
        ("C4", "helper's default floor 0 (autotuning backends lose theirs)", UTILS,
         [("min_num_tokens: int = 8192", "min_num_tokens: int = 0")]),
        ("C5", "capacity one token per rank too large", UTILS,
         [("max(moe_config.max_num_tokens * dp_size, min_num_tokens)",
           "max((moe_config.max_num_tokens + 1) * dp_size, min_num_tokens)")]),
        ("C6", "capacity ignores `elastic_ep_max_dp_size`/`dp_size` (dp 1)", UTILS,
         [("dp_size = moe_config.elastic_ep_max_dp_size or moe_config.dp_size",
           "dp_size = 1")]),
        ("L1", "registry holds wrappers strongly", MODULE,
         [("            wrappers = weakref.WeakValueDictionary()\n",
           "            wrappers = {}  # type: ignore[assignment]\n")]),
        ("L2", "owner entries never dropped (no finalize)", MODULE,
         [("            weakref.finalize(owner, self._by_owner.pop, owner_id, None)\n",
           "            pass\n")]),
        ("L3", "silent per-layer fallback without a current config", MODULE,
         [("        if owner is None:\n            raise RuntimeError(",
           "        if owner is None:\n            return factory()\n            raise RuntimeError(")]),  # noqa: E501 (one mutation per entry)
        ("L4", "layer holds the wrapper weakly", MODULE,
         [(ACQUIRE, "        self._wrapper: Any = weakref.proxy(\n" + ACQUIRE.split("= ", 1)[1] + ")")]),  # noqa: E501 (one mutation per entry)
        ("L5", "lazy acquisition in apply() (the 0.33.0 timing)", MODULE,
         [(ACQUIRE, "        self._wrapper: Any = None"),
          ("        wrapper_output = self._wrapper.run(",
           "        if self._wrapper is None:\n    " + ACQUIRE.replace("\n", "\n    ").lstrip()
           .replace("self._wrapper: Any = ", "        self._wrapper = ") + "\n"
           "        wrapper_output = self._wrapper.run(")]),
        ("L6", "apply() passes an input_global_scale to the shared wrapper", MODULE,
         [("            input_global_scale=None,\n",
           "            input_global_scale=self.a1_gscale,\n")]),
        ("C7", "capacity ignores `elastic_ep_max_dp_size` (uses `dp_size`)", UTILS,
         [("dp_size = moe_config.elastic_ep_max_dp_size or moe_config.dp_size",
           "dp_size = moe_config.dp_size")]),
        ("L7", "no guard against a folded input_global_scale", MODULE,
         [('        assert getattr(self._wrapper, "_folded_w1_alpha", None) is None, (',
           '        assert True or getattr(self._wrapper, "_folded_w1_alpha", None) is None, (')]),
        ("L8", "registry keeps every owner alive", MODULE,
         [("        owner_id = id(owner)\n",
           "        owner_id = id(owner)\n        self.__dict__.setdefault('_keep', []).append(owner)\n")]),  # noqa: E501 (one mutation per entry)
        ("L9", "module-level strong cache of every wrapper built", MODULE,
         [("            wrapper = factory()\n",
           "            wrapper = factory()\n            _KEEP.append(wrapper)\n"),
          ("_B12X_WRAPPERS = _B12xWrapperRegistry()\n",
           "_B12X_WRAPPERS = _B12xWrapperRegistry()\n_KEEP: list = []\n")]),
    ]
    # fmt: on
    return rows


# Runs every mutation in one interpreter: vLLM is imported once, and each
# mutation re-executes the two modules' (edited) sources in their module
# objects before pytest re-imports the test file. Much faster on a loaded
# host than one pytest process per mutation.
CHILD = r"""
import json, sys
from pathlib import Path
import pytest
import vllm.model_executor.layers.fused_moe.utils as U
import vllm.model_executor.layers.fused_moe.experts.flashinfer_b12x_moe as M

plan = json.loads(Path(sys.argv[1]).read_text())
mods = {plan["utils"]: U, plan["module"]: M}
orig = {rel: Path(mod.__file__).read_text() for rel, mod in mods.items()}


class Record:
    def __init__(self):
        self.failed = []

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(report.nodeid)


def load(texts):
    for rel in (plan["utils"], plan["module"]):  # the module imports from utils
        mod = mods[rel]
        exec(compile(texts[rel], mod.__file__, "exec"), mod.__dict__)
    for name in [n for n in sys.modules if n.startswith("tests.kernels.moe.test_")]:
        del sys.modules[name]


for mid, rel, edits in plan["mutations"]:
    texts = dict(orig)
    for old, new in edits:
        assert texts[rel].count(old) == 1, (mid, old)
        texts[rel] = texts[rel].replace(old, new)
    load(texts)
    rec = Record()
    stop = ["-x"] if plan["stop_at_first"] else []
    rc = pytest.main(["-p", "no:cacheprovider", *stop, "-q", "--no-header", "-p",
                      "no:warnings", *plan["tests"]], plugins=[rec])
    print("MUTATION " + json.dumps(dict(id=mid, rc=int(rc), failed=rec.failed)),
          flush=True)
load(orig)
"""


def first_failure(output: str) -> str:
    match = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if not match:
        return ""
    return match.group(1).split("::", 1)[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, help="the harness venv's python")
    parser.add_argument("--tree", required=True, help="the patched vLLM tree (tests)")
    parser.add_argument("--overlay", default=None, help="scratch dir (same filesystem as the venv)")
    parser.add_argument("--only", default="", help="comma-separated mutation ids")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--all-failures",
        action="store_true",
        help="with --in-process: run every test, list every failure",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="run all mutations in one interpreter (faster)"
    )
    args = parser.parse_args()

    python = Path(args.python).absolute()
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    tree = Path(args.tree).absolute()
    overlay = Path(args.overlay or python.parent.parent.parent / "mutation-overlay").absolute()
    if overlay.exists():
        shutil.rmtree(overlay)
    overlay.mkdir(parents=True)
    subprocess.run(["cp", "-al", str(site / "vllm"), str(overlay / "vllm")], check=True)
    # The patched sources, not the installed ones, are what is mutated.
    for rel in (MODULE, UTILS):
        (overlay / rel).unlink()
        shutil.copyfile(tree / rel, overlay / rel)

    # Tests run from a copy of tests/ (as `python -m harness test` does), so
    # that `vllm` resolves to the overlay and not to the tree's sources.
    rundir = overlay / "run"
    rundir.mkdir()
    subprocess.run(["cp", "-r", str(tree / "tests"), str(rundir / "tests")], check=True)
    shutil.copyfile(tree / "pyproject.toml", rundir / "pyproject.toml")
    env = {**os.environ, "PYTHONPATH": str(overlay), "VLLM_TARGET_DEVICE": "cpu"}
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import vllm.model_executor.layers.fused_moe.utils as m; print(m.__file__)",
        ],
        cwd=rundir,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not probe.startswith(str(overlay)):
        raise SystemExit(f"vllm resolves to {probe}, not to the overlay")
    only = set(filter(None, args.only.split(",")))
    rows = []
    if args.in_process:
        plan = dict(
            utils=UTILS,
            module=MODULE,
            tests=TESTS,
            stop_at_first=not args.all_failures,
            mutations=[
                (mid, rel, edits) for mid, _, rel, edits in mutations() if not only or mid in only
            ],
        )
        plan_file = overlay / "plan.json"
        plan_file.write_text(json.dumps(plan))
        what = {mid: (w, rel) for mid, w, rel, _ in mutations()}
        proc = subprocess.Popen(
            [str(python), "-c", CHILD, str(plan_file)],
            cwd=rundir,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("MUTATION "):
                continue
            result = json.loads(line[len("MUTATION ") :])
            caught = (
                ", ".join(f.split("::", 1)[-1] for f in result["failed"])
                if result["failed"]
                else "survived"
                if result["rc"] == 0
                else f"pytest exit {result['rc']}"
            )
            row = dict(
                id=result["id"],
                mutation=what[result["id"]][0],
                file=what[result["id"]][1],
                caught_by=caught,
            )
            rows.append(row)
            print(f"| {row['id']} | {row['mutation']} | `{caught}` |", flush=True)
        proc.wait()
    for mid, what, rel, edits in mutations():
        if args.in_process or (only and mid not in only):
            continue
        target = overlay / rel
        original = target.read_text()
        text = original
        for old, new in edits:
            if text.count(old) != 1:
                raise SystemExit(f"{mid}: {old!r} occurs {text.count(old)} times in {rel}")
            text = text.replace(old, new)
        target.write_text(text)
        start = time.monotonic()
        proc = subprocess.run(
            [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", *TESTS],
            cwd=rundir,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        target.write_text(original)
        caught = first_failure(proc.stdout + proc.stderr)
        if proc.returncode == 0:
            caught = "survived"
        elif not caught:
            caught = f"pytest exit {proc.returncode} (collection error)"
        row = dict(
            id=mid,
            mutation=what,
            file=rel,
            caught_by=caught,
            seconds=round(time.monotonic() - start, 1),
        )
        rows.append(row)
        print(f"| {mid} | {what} | `{caught}` |", flush=True)
    shutil.rmtree(overlay)
    if args.out:
        from harness import results

        data = {"tests": TESTS, "in_process": args.in_process, "rows": rows}
        tests_torch = subprocess.run(
            [str(python), "-c", "import torch; print(torch.__version__)"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        prov = results.provenance(
            [Path(sys.executable).name, *sys.argv],
            tree=str(tree),
            device="cpu",
            tests_python=str(python),
            tests_torch=tests_torch or "unknown",
        )
        results.write(Path(args.out), "b12x-mutations", data, prov)
    survived = [r for r in rows if r["caught_by"] == "survived" and r["id"] != "B0"]
    baseline = [r for r in rows if r["id"] == "B0"]
    return 1 if survived or any(r["caught_by"] != "survived" for r in baseline) else 0


if __name__ == "__main__":
    sys.exit(main())
