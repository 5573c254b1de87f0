"""``python -m harness``: the command line over the stage modules."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from harness import (
    build,
    bundle,
    checks,
    device_run,
    document,
    kernels,
    lint,
    matrix,
    patches,
    pinning,
    series,
    test,
    toolpins,
)
from harness.project import RELEASE_ENV, HarnessError, Identity, Project


def _identity(value: str) -> Identity:
    name, _, rest = value.partition("<")
    if not rest.endswith(">") or not name.strip():
        raise argparse.ArgumentTypeError("expected 'Full Name <email>'")
    return Identity(name.strip(), rest[:-1], "")


def _cmd_base(project: Project, args: argparse.Namespace) -> int:
    tree, base = series.prepare(project)
    print(f"{tree} {project.pin.release.tag} {base}")
    return 0


def _cmd_apply(project: Project, args: argparse.Namespace) -> int:
    applied = series.continue_apply(project) if args.resume else series.apply(project)
    for result in applied:
        print(f"{result.outcome.value:9} {result.patch}")
    return 0


def _cmd_reset(project: Project, args: argparse.Namespace) -> int:
    series.reset(project)
    return 0


def _cmd_export(project: Project, args: argparse.Namespace) -> int:
    written = series.export(
        project, signoff=args.signoff, author=args.author, out=args.out, force=args.force
    )
    for path in written:
        print(path)
    return 0


def _cmd_range_diff(project: Project, args: argparse.Namespace) -> int:
    print(series.range_diff(project, args.old, args.new), end="")
    return 0


def _cmd_hash(project: Project, args: argparse.Namespace) -> int:
    print(patches.series_hash(project))
    return 0


def _cmd_build(project: Project, args: argparse.Namespace) -> int:
    info = build.build(project, full=args.full, stock_kernels=args.stock_kernels)
    print(f"wheel: {info.wheel}")
    return 0


def _cmd_test(project: Project, args: argparse.Namespace) -> int:
    report = test.run_tests(project, args.pytest_args)
    for name, reason in report.skipped:
        print(f"SKIPPED {name}: {reason}")
    for name, reason in report.deselected:
        print(f"DESELECTED (patches/base.toml) {name}: {reason}")
    print(report.summary())
    return 0 if report.ok else 1


def _cmd_lint(project: Project, args: argparse.Namespace) -> int:
    failed = lint.lint(project)
    print("lint: " + (f"failed: {', '.join(failed)}" if failed else "all checks passed"))
    return 1 if failed else 0


def _cmd_check(project: Project, args: argparse.Namespace) -> int:
    problems = checks.check(project)
    for problem in problems:
        print(f"check: {problem}")
    print("check: " + ("FAILED" if problems else "round trip, standalone commits and SERIES.md ok"))
    return 1 if problems else 0


def _cmd_pin(project: Project, args: argparse.Namespace) -> int:
    if args.newer:
        newer = pinning.newer_releases(project)
        print("\n".join(newer) if newer else "no release on the index is newer than every pin")
        return 1 if newer else 0
    if args.version is None:
        raise HarnessError("name the release to pin (e.g. `pin 0.35.0`), or pass --newer")
    entry = pinning.pin(project, args.version, series=args.series)
    print(pinning.render_entry(entry), end="")
    print(f"appended to {project.pin_file}; `VLLM_SERIES_VLLM={args.version} nox -s apply` next")
    return 0


def _cmd_lock(project: Project, args: argparse.Namespace) -> int:
    change = toolpins.relock(project.root, upgrade=args.upgrade)
    print("\n".join(change.lines()))
    return 0


def _cmd_doc(project: Project, args: argparse.Namespace) -> int:
    changed = document.update(project)
    print("updated: " + ", ".join(changed) if changed else "documents already up to date")
    return 0


def _cmd_matrix(project: Project, args: argparse.Namespace) -> int:
    data = matrix.run_matrix(project, test_releases=args.test)
    for row in data["rows"]:
        cells = ", ".join(
            f"{v}: {c['outcome']}"
            + (
                f" / build {c['build']['result']} / test {c['test']['result']}"
                if "test" in c
                else ""
            )
            for v, c in row["cells"].items()
        )
        print(f"{row['patch']}: {cells}")
    for version in data.get("newer_on_index", []):
        print(f"vLLM {version} is on the index and newer than every pin: "
              f"`python -m harness pin {version}`")  # fmt: skip
    failed = matrix.failures(data)
    if failed:
        print("matrix: failed: " + ", ".join(failed))
    return 1 if failed else 0


def _cmd_bundle(project: Project, args: argparse.Namespace) -> int:
    if args.wheel_group:
        folder, parts = bundle.build_wheel_parts(
            project,
            args.wheel_group,
            out=args.out,
            part_bytes=None if args.part_mib is None else args.part_mib * bundle.MiB,
        )
        shown = os.path.relpath(folder, project.root)
        print(f"{folder}: {len(parts['parts'])} parts of {parts['tar_bytes'] / bundle.MiB:.1f} MiB")
        for part in parts["parts"]:
            print(f"  carry {shown}/{part['name']} in a call of its own")
        print(f"  and {shown}/{device_run.PARTS_MANIFEST} with the last one")
        return 0
    if args.carry_plan:
        folder = args.out or bundle.default_out(project)
        if not (folder / "provenance.json").is_file():
            raise HarnessError(f"{folder} is not a device bundle: build it first")
        print(bundle.plan_carry(project.root, folder).describe())
        return 0
    built = bundle.build_bundle(
        project,
        out=args.out,
        revision=args.rev,
        target_sm=args.sm,
        tests=args.test,
        extra_kernels=[bundle.ExtraKernel.parse(k) for k in args.kernel],
        stock_kernels=args.stock_kernels,
        max_bytes=args.max_mib * bundle.MiB,
    )
    print(f"{built.path} ({built.total_bytes / bundle.MiB:.1f} MiB)")
    try:
        print(bundle.plan_carry(project.root, built.path).describe())
    except HarnessError as exc:  # the bundle is built; only its carrying needs thought
        print(f"warning: no carry plan: {exc}", file=sys.stderr)
    return 0


Handler = Callable[[Project, argparse.Namespace], int]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m harness",
        description=(
            "Apply, export, check, build and test the vLLM MoE expert-offload patch "
            "series on its pinned vLLM release. The vLLM tree lives in "
            "$VLLM_SERIES_WORK (default .work/vllm); downloads are cached in "
            "$VLLM_SERIES_CACHE (default ~/.cache/vllm-series). $VLLM_SERIES_VLLM=VERSION "
            "runs base, apply, build, test and lint on another release pinned in "
            "patches/base.toml, in its own work area ($VLLM_SERIES_WORK/releases/VERSION)."
        ),
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(handler=handler)
        return cmd

    add("base", _cmd_base, "fetch, verify and materialize the pinned base as a git tree")
    apply = add(
        "apply",
        _cmd_apply,
        "rebuild the `series` branch from the base and apply patches/ in order "
        "(refuses uncommitted or unexported work)",
    )
    apply.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="finish a stopped apply (after resolving the conflict and `git add`) and "
        "apply the rest of the series",
    )
    add("reset", _cmd_reset, "abort a stopped apply and return `series` to the base")
    export = add("export", _cmd_export, "regenerate patches/ from the commits on `series`")
    export.add_argument(
        "--signoff",
        type=_identity,
        metavar="'NAME <EMAIL>'",
        help="add the submitter's Signed-off-by (needs --out: patches/ stays canonical)",
    )
    export.add_argument(
        "--author",
        type=_identity,
        metavar="'NAME <EMAIL>'",
        help="the submitter as From: of every patch (needs --out)",
    )
    export.add_argument(
        "--out",
        type=_path,
        help="write a submission copy (cover letter, upstream base) here instead of patches/",
    )
    export.add_argument(
        "--force",
        action="store_true",
        help="write even when patches/ would lose patches or changes (export names them)",
    )
    rd = add(
        "range-diff",
        _cmd_range_diff,
        "git range-diff between two versions of the series: `tree` (the tree's series "
        "branch), `patches` (patches/ on disk) or a revision of this repository",
    )
    rd.add_argument("old", nargs="?", default="HEAD", help="old side (default: HEAD)")
    rd.add_argument("new", nargs="?", default="tree", help="new side (default: tree)")
    add("hash", _cmd_hash, "print the series hash (sha256 of patches/series and the patches)")
    b = add(
        "build", _cmd_build, "build the vLLM wheel of the applied series (python-only by default)"
    )
    b.add_argument("--full", action="store_true", help="normal CUDA build (needs CUDA and network)")
    b.add_argument(
        "--stock-kernels",
        action="store_true",
        help="build python-only even though the series changes compiled sources; "
        "those are built by `python -m harness kernels` instead",
    )
    t = add(
        "test",
        _cmd_test,
        "run the tests the series adds or changes, from the patched tree, against the "
        "built wheel (GPU tests skip with their reasons on hosts without one)",
    )
    t.add_argument("pytest_args", nargs="*", help="extra pytest arguments (`--` optional)")
    add("lint", _cmd_lint, "vLLM's own checks (ruff, typos, mypy, SPDX, ...) on touched files")
    add(
        "check",
        _cmd_check,
        "apply + export reproduces patches/ byte for byte, every patch is authored and "
        "signed off by the pinned identity, each commit applies alone on its stated base, "
        "result files are well-formed, generated blocks are current, and "
        "docs/expert-pool.md matches the tree's docs/features/moe_expert_pool.md",
    )
    add(
        "doc",
        _cmd_doc,
        "rewrite the generated blocks of README.md (Which flag), SERIES.md (header, "
        "commits, revision matrix), results/README.md (claims, Which flag) and "
        "results/e2e-v0.34.0/README.md (Which flag)",
    )
    kernels.add_arguments(
        add(
            "kernels",
            kernels.command,
            "build the Marlin MoE ops the series changes from one revision of the tree, for "
            "one GPU architecture and a few weight formats (default formats: NVFP4, FP8, "
            "GPTQ int4, AWQ int4, MXFP4, MXFP8), under their own op namespace, so a stock "
            "and a patched build load side by side (minutes, offline)",
        )
    )
    bnd = add(
        "bundle",
        _cmd_bundle,
        "pack the patched tree's vllm/, its tests, the release's kernel libraries pruned "
        "to one GPU architecture and the wheels a torch-only GPU host lacks into one "
        "folder (<= 60 MiB); on that host `python3 BUNDLE/device_run.py --out DIR` "
        "installs it, smoke-checks it and runs the tests (docs/device-bundle.md)",
    )
    bnd.add_argument("--out", type=_path, help="bundle folder (default: .bundle)")
    bnd.add_argument(
        "--wheel-group",
        metavar="NAME",
        help="instead of the bundle, split the wheels of this device-wheels.toml group "
        "(e.g. flashinfer) into parts, one device call each (default out: "
        ".bundle-wheels/NAME; on the host: device_run.py --wheel-parts FOLDER)",
    )
    bnd.add_argument(
        "--part-mib",
        type=int,
        help="largest part, MiB (default: what one call leaves beside the working tree)",
    )
    bnd.add_argument("--rev", default="series", help="tree revision to pack (default: series)")
    bnd.add_argument("--sm", type=int, default=90, help="target GPU architecture (default: 90)")
    bnd.add_argument(
        "--test", action="append", default=[], help="extra test file to carry (repeatable)"
    )
    bnd.add_argument(
        "--kernel",
        action="append",
        default=[],
        metavar="PATH:NAMESPACE",
        help="a kernel library from `harness kernels` to carry (repeatable)",
    )
    bnd.add_argument(
        "--max-mib",
        type=int,
        default=bundle.DEFAULT_MAX_BYTES // bundle.MiB,
        help=f"largest bundle, MiB (default: {bundle.DEFAULT_MAX_BYTES // bundle.MiB}, one "
        "call with the working tree); a larger one reaches the host over several calls in a "
        "row, as the carry plan printed at the end says",
    )
    bnd.add_argument(
        "--carry-plan",
        action="store_true",
        help="build nothing: say how the existing bundle and the working tree reach the "
        "GPU host, in one device call or several in a row (each carries at most 64 MiB)",
    )
    bnd.add_argument(
        "--stock-kernels",
        action="store_true",
        help="bundle without the series' kernels although it changes compiled sources "
        "(its kernel tests then fail on the release's kernels)",
    )
    mx = add(
        "matrix",
        _cmd_matrix,
        "classify, on each release listed in patches/base.toml, that release's own series "
        "(patches/ or the backport folder its `series` key names): clean / 3way / rebase / "
        "upstream / blocked (a patch it requires does not apply) / absent (the release's "
        "series has no such patch); writes results/matrix.json and SERIES.md",
    )
    mx.add_argument(
        "--test",
        action="store_true",
        help="then, on each release where the whole series applies, apply, build (python-only) "
        "and run the series' CPU tests in that release's own work area, timed per cell "
        "(exit 1 when a step fails there)",
    )
    pn = add(
        "pin",
        _cmd_pin,
        "pin a vLLM release from the package index: downloads its sdist and release wheel, "
        "computes their sha256, reads the upstream commit (vllm/_version.py) and the torch and "
        "FlashInfer pins (requirements/cuda.txt) from the sdist, makes the synthetic base "
        "commit, and appends the [[matrix]] entry to patches/base.toml",
    )
    pn.add_argument("version", nargs="?", help="the release to pin, e.g. 0.35.0")
    pn.add_argument(
        "--series",
        metavar="FOLDER",
        help="the backport folder under patches/ that release uses (default: the main series)",
    )
    pn.add_argument(
        "--newer",
        action="store_true",
        help="pin nothing: list the releases on the index newer than every pin (exit 1 when "
        "there is one, so a scheduled job notices)",
    )
    lk = add(
        "lock",
        _cmd_lock,
        f"re-resolve {toolpins.LOCK}, the versions of every tool the harness installs "
        "(nox's harness session, the harness venv's test requirements, lint's unpinned hook "
        f"dependencies) and of what they need, from {toolpins.REQUIREMENTS} with `uv pip "
        "compile` (needs the package index), and print what changed: `name old -> new`, "
        "added, removed. Without --upgrade the locked versions stay where they still resolve, "
        "so only what a change of the requirements needs moves; commit the lock with it",
    )
    lk.add_argument(
        "--upgrade",
        action="store_true",
        help="move every package to the newest version that resolves (`nox -s harness` and "
        "`nox -s lint` then try the new versions before the lock is committed)",
    )
    _add_replay_commands(add)
    _add_bank_sim_command(add)
    return top


def _add_bank_sim_command(add: Callable[[str, Handler, str], argparse.ArgumentParser]) -> None:
    """``bank-sim``: see harness/bank_sim.py."""
    bs = add(
        "bank-sim",
        _cmd_bank_sim,
        "simulate the expert pool's bank on the CPU (L layers of R placement rows in one global "
        "LRU; per layer step, hits refresh their rows, up to top_k misses, most-routed first, "
        "are promoted into a row of any layer, the rest staged; every miss copies one row) and "
        "compare admission/eviction policies: promote-on-miss (today's planner), second-miss, "
        "frequency (TinyLFU-style admission), lfru (frequency-aware LRU eviction). The route "
        "traces (skewed, uniform, drifting) are SYNTHETIC, drawn from the router's distribution, "
        "not recorded from a served run. Writes OUT/bank-sim.json (with provenance) and prints "
        "hit rates, misses per step and misses relative to promote-on-miss; nothing about GPU "
        "time (harness/bank_sim.py)",
    )
    bs.add_argument("--rows", type=_ints, default=[22, 32], help="rows per layer (default 22,32)")
    bs.add_argument(
        "--tokens",
        type=_ints,
        default=[1, 8],
        help="tokens per decode step: 1 = one request decoding, 8 = eight (default 1,8)",
    )
    bs.add_argument(
        "--steps",
        type=int,
        default=5000,
        help="decode steps per trace (default 5000; the first 20%% are warm-up)",
    )
    bs.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    bs.add_argument("--layers", type=int, default=42, help="pooled layers (default 42)")
    bs.add_argument("--experts", type=int, default=128, help="experts per layer (default 128)")
    bs.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    bs.add_argument(
        "--drift-every",
        type=int,
        default=300,
        help="drifting trace: steps between redraws of each layer's popularity (default 300)",
    )
    bs.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="NAME[:KEY=VALUE...]",
        help="a policy to run, repeatable (default: promote-on-miss, second-miss, frequency, "
        "lfru with their defaults; promote-on-miss always runs, as the reference); parameters: "
        "second-miss:window=STEPS (200), frequency:half_life=STEPS (100), "
        "lfru:half_life=STEPS:candidates=ROWS (100, 32)",
    )
    bs.add_argument("--out", type=_path, help="result folder (default results/bank-sim/)")


def _cmd_bank_sim(project: Project, args: argparse.Namespace) -> int:
    from harness import bank_sim

    out = args.out or project.results / "bank-sim"
    policies = args.policies or list(bank_sim.POLICIES)
    try:
        for spec in policies:
            bank_sim.make_policy(spec)
    except ValueError as exc:
        raise HarnessError(str(exc)) from exc
    shown = os.path.relpath(out, project.root) if out.is_relative_to(project.root) else str(out)
    argv = [  # every setting spelled out, so the recorded command reproduces the run
        "bank-sim", "--rows", ",".join(map(str, args.rows)),
        "--tokens", ",".join(map(str, args.tokens)), "--steps", str(args.steps),
        "--seed", str(args.seed), "--layers", str(args.layers), "--experts", str(args.experts),
        "--top-k", str(args.top_k), "--drift-every", str(args.drift_every),
        *[f"--policy={spec}" for spec in policies], "--out", shown,
    ]  # fmt: skip
    try:
        return bank_sim.main(
            out,
            argv=argv,
            rows=args.rows, tokens=args.tokens, steps=args.steps, seed=args.seed,
            layers=args.layers, experts=args.experts, top_k=args.top_k,
            drift_every=args.drift_every, policies=policies,
        )  # fmt: skip
    except ValueError as exc:  # a trace or bank that cannot be (top_k above experts, ...)
        raise HarnessError(str(exc)) from exc


def _add_replay_commands(add: Callable[[str, Handler, str], argparse.ArgumentParser]) -> None:
    """``replay``, ``checkpoint`` and ``selftest``: see their modules."""
    r = add(
        "replay",
        _cmd_replay,
        "serve and benchmark the built wheel: start `vllm serve` with each arm (server "
        "configuration) of a profile, drive it with `vllm bench serve`, sample NVML, write "
        "one result JSON per run. ttft, decode, oom: the seeds' serving claims (profiles: "
        "harness/data/replay_profiles.toml); e2e: the expert pool against vLLM's offload "
        "flags (profiles: harness/data/e2e_profiles.toml); soak: churn, bad requests, SIGTERM "
        "and start-up faults of a served pool, with issue #38's goal checks (profiles: "
        "harness/data/soak_profiles.toml); plot: draw an existing folder",
    )
    r.add_argument(
        "experiment",
        choices=["ttft", "decode", "oom", "plot", "e2e", "soak"],
        help="what to measure (see above)",
    )
    r.add_argument(
        "--profile",
        help="profile name (default tiny-synthetic; e2e: glm-shape-h200, from "
        "harness/data/e2e_profiles.toml; soak: glm-shape-h200, from "
        "harness/data/soak_profiles.toml)",
    )
    r.add_argument("--out", type=_path, help="result folder (default: results/replay/DATE-PROFILE)")
    r.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    r.add_argument(
        "--python", type=_interpreter, help="venv python with vLLM (default: harness venv)"
    )
    r.add_argument(
        "--vllm-command",
        type=shlex.split,
        default=[],
        metavar="CMD",
        help="command line that runs vLLM's CLI, for `serve` and `bench serve` (default: the "
        "`vllm` script beside --python); e.g. 'python3 -m vllm.entrypoints.cli.main' where "
        "vLLM is on PYTHONPATH without a console script (the device bundle)",
    )
    r.add_argument("--port", type=int, help="server port (default: a free one)")
    e = r.add_argument_group(
        "e2e (the pool against vLLM's UVA and prefetch offload); soak also takes --arms, "
        "--checkpoint, --deadline-s and --summarize"
    )
    e.add_argument(
        "--arms",
        type=_csv,
        default=[],
        help="arms, comma-separated, of resident, pool, pool-host-view, pool-frequency, uva, "
        "prefetch "
        "(default: all of the profile's; soak: the soak profile's, pool and resident)",
    )
    e.add_argument("--routers", type=_csv, default=[], help="uniform,skewed (default: profile's)")
    e.add_argument("--experts", type=int, help="experts per layer (256: the 256-expert variant)")
    e.add_argument(
        "--checkpoint",
        type=_path,
        help="checkpoint folder, written unless current (default OUT/checkpoint; soak "
        "writes only its profile's router)",
    )
    e.add_argument(
        "--no-spec", action="store_true", help="skip the ngram speculative-decoding servers"
    )
    e.add_argument(
        "--spec-only",
        action="store_true",
        help="start only the ngram speculative-decoding servers (their decode runs at the "
        "profile's spec concurrencies), not the arms' plain servers",
    )
    e.add_argument(
        "--concurrency",
        type=lambda v: [int(x) for x in _csv(v)],
        default=[],
        help="decode concurrencies, comma-separated (default: the profile's)",
    )
    e.add_argument("--no-ttft", action="store_true", help="skip the TTFT runs")
    e.add_argument(
        "--no-online",
        action="store_true",
        help="skip the online runs (Poisson arrivals of mixed lengths at the profile's "
        "online_rates)",
    )
    e.add_argument(
        "--online-rates",
        type=lambda v: [float(x) for x in _csv(v)],
        default=[],
        help="online request rates per second, comma-separated (default: the profile's "
        "online_rates); each run sends rate x online_duration_s requests",
    )
    e.add_argument(
        "--pool-rows",
        type=int,
        metavar="N",
        help="size every pool arm with --moe-expert-pool-rows N instead of the profile's "
        "budget in GiB, to compare trees whose --moe-expert-pool-gb counts different things "
        "(e2e only)",
    )
    e.add_argument(
        "--no-decode",
        action="store_true",
        help="skip the decode runs (TTFT only; needs --no-spec, since the ngram servers only "
        "decode)",
    )
    e.add_argument(
        "--deadline-s",
        type=float,
        metavar="SECONDS",
        help="time the run has, from its start: a server start or decode bench that cannot "
        "finish in the time left is skipped and named in the log (a server needs the "
        "fastest successful start of this run, or the profile's startup_floor_s before "
        "the first; a decode bench 0.9 x the median inter-token "
        "latency of the server's earlier benches at as many requests or fewer x its output "
        "tokens), and summary.json is written, also when a time limit interrupts the run; "
        "under device_run.py the run also keeps to the time that device_run.py gives it "
        "(VLLM_BUNDLE_TIME_LEFT_S, less 15 s to stop its last server), so this is only "
        "needed for a tighter limit. soak: an arm starts when the fastest start, its churn "
        "and what follows fit (the churn is cut to the time left), a fault when the "
        "fastest start (a failing one: the profile's fault_floor_s) fits",
    )
    e.add_argument(
        "--summarize",
        type=_path,
        metavar="DIR",
        help="measure nothing: write DIR/summary.json and plots over every run folder in DIR "
        "(e.g. results/e2e); soak: DIR/summary.json and summary.md of one soak folder",
    )
    k = r.add_argument_group(
        "soak (churn, bad requests, SIGTERM and start-up faults of a served pool: docs/soak.md)"
    )
    k.add_argument(
        "--faults",
        type=_csv,
        nargs="?",
        const=[],
        metavar="NAMES",
        help="start the server with the profile's bad pool configurations instead of "
        "soaking the arms (all of them, or the comma-separated NAMES of rows-below-top-k, "
        "rows-above-experts, gb-above-experts, rows-and-gb, dense-model, non-nvfp4-moe, "
        "pin-memory-disabled, host-ram-below-pool; the dense and bf16 models of two of "
        "them are small ones the run writes under OUT/models), and record whether each "
        "fails before weight loading with the message the tree gives, or starts where "
        "that is documented",
    )
    k.add_argument(
        "--churn-s",
        type=float,
        metavar="SECONDS",
        help="how long each arm's churn lasts (default: the profile's duration_s)",
    )
    c = add(
        "checkpoint",
        _cmd_checkpoint,
        "write a synthetic ModelOpt NVFP4 Qwen3-MoE checkpoint (random weights, byte-level "
        "tokenizer, no download): small by default, or a preset's shape",
    )
    c.add_argument("out", type=_path, help="checkpoint folder to write")
    for name in ("layers", "experts", "top_k", "hidden_size", "moe_intermediate_size", "seed"):
        c.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            dest=name,
            help=f"{CHECKPOINT_FIELDS[name]} (default: the preset's, else a small model's)",
        )
    c.add_argument(
        "--preset",
        choices=["glm-shape"],
        help="the seed's per-GPU expert shape (42 x 128 experts, ~36 GiB), written with numpy in "
        "parallel, one folder per router under OUT (harness/checkpoint_routed.py)",
    )
    c.add_argument(
        "--routers", type=_csv, default=["uniform", "skewed"], help="with --preset: uniform,skewed"
    )
    s = add("selftest", _cmd_selftest, "the harness tests that need vLLM (tests/wheel)")
    s.add_argument("pytest_args", nargs="*", help="extra pytest arguments (`--` optional)")


CHECKPOINT_FIELDS = {
    "layers": "MoE layers",
    "experts": "routed experts per layer",
    "top_k": "experts each token is routed to",
    "hidden_size": "hidden size",
    "moe_intermediate_size": "intermediate size of each expert",
    "seed": "random seed of the weights",
}


def _cmd_replay(project: Project, args: argparse.Namespace) -> int:
    from harness import replay

    if args.experiment in ("e2e", "soak"):
        return _cmd_served(project, args)
    return replay.main(
        project, args.experiment, args.profile or "tiny-synthetic", out=args.out,
        dry_run=args.dry_run,
        python=args.python, vllm_command=args.vllm_command, port=args.port, argv=sys.argv[1:],
    )  # fmt: skip


def _cmd_served(project: Project, args: argparse.Namespace) -> int:
    """``replay e2e`` and ``replay soak``: profiles of harness/data, results/KIND/DATE-PROFILE."""
    import datetime

    from harness import e2e, replay, soak

    soaking = args.experiment == "soak"
    if args.summarize:
        for path in (soak.write_summary if soaking else e2e.write_summary)(args.summarize):
            print(path)
        return 0
    profile = args.profile or "glm-shape-h200"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = args.out or project.results / args.experiment / f"{stamp}-{profile}"
    python = replay.server_python(project, args.python, args.dry_run)
    if soaking:
        return soak.main(
            profile, out, python=python, vllm_command=args.vllm_command, arms=args.arms,
            checkpoint_dir=args.checkpoint, faults=args.faults, churn_s=args.churn_s,
            dry_run=args.dry_run,
            deadline_s=args.deadline_s, argv=sys.argv[1:],
        )  # fmt: skip
    return e2e.main(
        profile, out, python=python, vllm_command=args.vllm_command, arms=args.arms,
        routers=args.routers, experts=args.experts, checkpoint_dir=args.checkpoint,
        speculative=not args.no_spec, plain=not args.spec_only, concurrency=args.concurrency,
        ttft=not args.no_ttft, decode=not args.no_decode, online=not args.no_online,
        online_rates=args.online_rates, pool_rows=args.pool_rows, dry_run=args.dry_run,
        deadline_s=args.deadline_s, argv=sys.argv[1:],
    )  # fmt: skip


def _cmd_checkpoint(project: Project, args: argparse.Namespace) -> int:
    from harness import checkpoint

    fields = ("layers", "experts", "top_k", "hidden_size", "moe_intermediate_size", "seed")
    given = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    if args.preset:
        import dataclasses

        from harness import checkpoint_routed

        spec = dataclasses.replace(checkpoint_routed.PRESETS[args.preset], **given)
        try:
            for folder in checkpoint_routed.write(args.out, spec, args.routers).values():
                print(folder)
        except ValueError as exc:
            raise HarnessError(str(exc)) from exc
        return 0
    spec = checkpoint.Spec(**given)
    try:
        print(checkpoint.write(args.out, spec))
    except ValueError as exc:
        raise HarnessError(str(exc)) from exc
    return 0


def _cmd_selftest(project: Project, args: argparse.Namespace) -> int:
    from harness import selftest

    return selftest.run(project, args.pytest_args)


def _csv(value: str) -> list[str]:
    return [item for item in value.split(",") if item]


def _ints(value: str) -> list[int]:
    return [int(item) for item in _csv(value)]


def _path(value: str) -> Path:
    return Path(value).resolve()


def _interpreter(value: str) -> Path:
    """Absolute, symlinks kept: a venv's ``bin/python`` is a link that resolves out of the venv."""
    return Path(value).absolute()


# Commands whose further arguments all go to pytest, options included.
PYTEST_COMMANDS = ("test", "selftest")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; after ``test`` or ``selftest`` everything is pytest's (a leading
    ``--`` is dropped), except a lone ``-h``/``--help``."""
    argv = list(argv)
    if argv and argv[0] in PYTEST_COMMANDS and argv[1:] not in (["-h"], ["--help"]):
        rest = argv[1:]
        args = parser().parse_args(argv[:1])
        args.pytest_args = rest[1:] if rest[:1] == ["--"] else rest
        return args
    return parser().parse_args(argv)


# Commands that read or write what is made on [base]'s release only (SERIES.md,
# the results, the release kernels, the pins; `check` covers every series): on
# another release they would record that release's base in place of the series' own.
MAIN_ONLY = ("check", "doc", "matrix", "bundle", "kernels", "replay", "pin")
# Commands that write a series folder: on the release it is made on (patches/ on
# [base]'s, a backport folder such as patches/0.33.0 on its own release).
HOME_ONLY = ("export",)


def refuse_off_default(project: Project, args: argparse.Namespace) -> None:
    """Refuse a :data:`MAIN_ONLY` command when ``$VLLM_SERIES_VLLM`` selects another release
    than ``[base]``'s, and a :data:`HOME_ONLY` one off the release its series is made on.

    ``export --out DIR`` (a submission copy for that release) is allowed anywhere.
    """
    pin = project.pin
    if args.command in HOME_ONLY and not project.on_default and args.out is None:
        raise HarnessError(
            f"`{args.command}` writes {project.patches.relative_to(project.root)}, which is made "
            f"on vLLM {pin.home}, but {RELEASE_ENV}={project.vllm} selects another; set "
            f"{RELEASE_ENV}={pin.home} (or `export --out DIR` for a copy for vLLM {project.vllm})"
        )
    if args.command in MAIN_ONLY and project.vllm is not None and not pin.is_default:
        raise HarnessError(
            f"`{args.command}` works on vLLM {pin.default.version}, the release patches/ "
            f"is made on, but {RELEASE_ENV}={project.vllm} selects another; unset it (the "
            f"per-release commands are base, apply, reset, range-diff, build, test, selftest, "
            f"lint, and export on a backport's own release; check covers every backport)"
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        project = Project.discover()
        refuse_off_default(project, args)
        return int(args.handler(project, args))
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
