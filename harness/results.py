"""Stage 6: results with provenance, and the claims table in ``results/README.md``.

Every result file is one JSON object::

    {"schema": 1, "kind": "...", "provenance": {...}, "data": {...}}

``provenance`` names what ran (command, date), where (host, GPU, driver, CUDA,
torch, Python) and on what (vLLM base pin, series hash, tree commit, wheel
hash). Scripts that run on a GPU host import this module straight from the
repository copy that travels with them; it needs only the standard library
(torch is used when it is importable).

``results/claims.toml`` lists the seeds' claims; ``python -m harness doc``
renders them, with our values read from the result files (``ours_from``: one
JSON pointer or a list of them, formatted by ``ours_format``), into the
generated block of ``results/README.md``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any

from harness.patches import series_hash
from harness.project import HarnessError, Project, nvidia_smi

SCHEMA = 1
# Set by the device bundle's runner (harness/device_run.py, which travels alone and
# keeps its own copy of the name) to the commit of the tree it ships.
BUNDLE_TREE_ENV = "VLLM_BUNDLE_TREE_COMMIT"
# Set beside it only when that tree is the series' head: the bundle's series hash.
BUNDLE_SERIES_ENV = "VLLM_BUNDLE_SERIES_HASH"
#: ``series_hash`` of a record made under a bundle of another revision (a probe).
NOT_THE_SERIES = "not the series"
REQUIRED = ("command", "date", "host", "gpu", "driver", "cuda", "torch", "python", "base")


def gpu_and_driver() -> tuple[str, str]:
    """``("NVIDIA H200", "580.159.04")``, ``("2x NVIDIA H200", ...)``, or ``("none", "none")``."""
    rows = nvidia_smi("name", "driver_version")
    if rows is None:
        return "none", "none"
    names = [row[0] for row in rows]
    gpu = names[0] if len(set(names)) == 1 else "; ".join(names)
    return (f"{len(names)}x {gpu}" if len(names) > 1 else gpu), rows[0][1]


def _torch() -> tuple[str, str]:
    try:
        import torch
    except ImportError:
        return "not installed", "none"
    return torch.__version__, str(torch.version.cuda or "none")


def _series(project: Project) -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        info["series_hash"] = series_hash(project)
    except (OSError, HarnessError):
        info["series_hash"] = "unknown"
    build_json = project.work / "dist" / "build.json"
    if build_json.exists():
        built = json.loads(build_json.read_text())
        # A wheel built from another series is not what this record measured.
        if built.get("series_hash") == info["series_hash"]:
            info["wheel_sha256"] = built["wheel_sha256"]
            info["tree_commit"] = built["tree_commit"]
        else:
            info["stale_build"] = f"the built wheel is of series {built.get('series_hash')}"
    elif os.environ.get(BUNDLE_TREE_ENV):
        # Under device_run.py: no wheel, the device bundle's tree is what runs.
        info["tree_commit"] = os.environ[BUNDLE_TREE_ENV]
        info["vllm_from"] = "device bundle"
        info["series_hash"] = os.environ.get(BUNDLE_SERIES_ENV) or NOT_THE_SERIES
    return info


def provenance(command: str | list[str] | None = None, **extra: str) -> dict[str, Any]:
    """Where, when and on what a result was produced."""
    project = Project.discover()
    pin = project.pin
    gpu, driver = gpu_and_driver()
    torch_version, cuda = _torch()
    if command is None:
        command = [Path(sys.argv[0]).name, *sys.argv[1:]]
    return {
        "command": command if isinstance(command, str) else shlex.join(command),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node() or "unknown",
        "gpu": gpu,
        "driver": driver,
        "cuda": cuda,
        "torch": torch_version,
        "python": platform.python_version(),
        "base": {
            "version": pin.release.version,
            "sdist_sha256": pin.release.sdist_sha256,
            "upstream_commit": pin.upstream_commit,
            "base_commit": pin.base_commit,
        },
        **_series(project),
        **extra,
    }


def write(path: Path, kind: str, data: dict[str, Any], prov: dict[str, Any]) -> Path:
    """Write one result file; refuse one whose provenance lacks a required field."""
    missing = [k for k in REQUIRED if k not in prov]
    if missing:
        raise HarnessError(f"provenance for {path} lacks {missing}")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"schema": SCHEMA, "kind": kind, "provenance": prov, "data": data}
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


# Row keys of the summaries (harness.e2e.summarize, harness.soak.summarize,
# scripts/staging_replay.py), which hold their rows at the top level instead of under ``data``.
SUMMARY_ROWS: dict[str, tuple[str, ...]] = {
    "e2e-summary": ("decode", "ttft"),
    "soak-summary": ("arms", "faults"),
    "staging-summary": ("rows",),
}


def validate(path: Path) -> list[str]:
    """Problems with one result file (empty when it is well-formed)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return [f"{path}: unreadable: {exc}"]
    if not isinstance(record, dict):
        return [
            f"{path}: not a result record (a JSON object with schema, kind, "
            "provenance and data; write it with harness.results.write)"
        ]
    problems = []
    if record.get("schema") != SCHEMA:
        problems.append(f"{path}: schema is {record.get('schema')!r}, expected {SCHEMA}")
    prov = record.get("provenance", {})
    problems += [f"{path}: provenance lacks {k}" for k in REQUIRED if k not in prov]
    # A summary holds its rows at the top level.
    rows = SUMMARY_ROWS.get(str(record.get("kind")), ("data",))
    problems += [f"{path}: no {key}" for key in rows if key not in record]
    return problems


def lookup(root: Path, ref: str) -> Any:
    """Resolve ``file.json#/a/b/0`` (a JSON pointer into a result file under ``root``)."""
    file, _, pointer = ref.partition("#")
    value: Any = json.loads((root / file).read_text())
    for part in filter(None, pointer.split("/")):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def _ours(project: Project, claim: dict[str, Any], prefix: str, default: str) -> str:
    """A claim's value from ``PREFIX_from`` pointers and ``PREFIX_format``, else ``PREFIX``."""
    if refs := claim.get(f"{prefix}_from"):
        refs = [refs] if isinstance(refs, str) else refs
        try:
            values = [lookup(project.root, ref) for ref in refs]
        except (OSError, KeyError, IndexError, ValueError) as exc:
            raise HarnessError(f"claim {claim['id']}: cannot read {refs}: {exc}") from exc
        return str(claim.get(f"{prefix}_format", "{}").format(*values))
    return str(claim.get(prefix, default))


def render_claims(project: Project) -> str:
    """The claims table: seed value, ours (read from the result files), method, command.

    ``e2e``/``e2e_from`` give our end-to-end value on synthetic weights beside
    each seed end-to-end claim; the file's ``e2e_differs`` says, under the table,
    what differs from the seeds' setups.
    """
    data = tomllib.loads((project.results / "claims.toml").read_text())
    lines = [
        "| claim | seed | ours | ours, end to end on synthetic weights (H200) | method "
        "| command | file |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for claim in data["claim"]:
        ours = _ours(project, claim, "ours", "not run here")
        e2e = _ours(project, claim, "e2e", "")
        file = claim.get("file", "")
        link = f"[{Path(file).name}]({os.path.relpath(project.root / file, project.results)})"
        lines.append(
            f"| {claim['id']}: {claim['claim']} | {claim['seed']} | {ours} | {e2e} "
            f"| {claim['method']} | `{claim['command']}` | {link if file else ''} |"
        )
    if differs := data.get("e2e_differs"):
        lines += ["", f"End to end on synthetic weights: {differs}"]
    return "\n".join(lines) + "\n"


def check_all(root: Path) -> list[str]:
    """Validate every result JSON under ``results/`` (the revision matrix included)."""
    problems: list[str] = []
    for path in sorted((root / "results").rglob("*.json")):
        problems += validate(path)
    return problems
