"""Stage 7b: the expert pool against vLLM's own offload backends, end to end.

``python -m harness replay e2e --profile glm-shape-h200`` answers the question a
user with an NVFP4 MoE model that does not fit asks ("which flag?") and the one
a maintainer asks before merging an expert cache ("does it hold at prefill, at
concurrency 32, with speculative decoding?"): every arm of a profile
(``harness/data/e2e_profiles.toml``) serves the same synthetic checkpoint
(:mod:`harness.checkpoint_routed`, written on the GPU host) through ``vllm
serve`` with the same GPU budget for expert weights, and ``vllm bench serve``
measures, per arm and router:

* TTFT of single requests at the seed's prompt lengths (12.5K and 81.6K tokens);
* decode tok/s (``1000 / mean TPOT``) at each concurrency, ``concurrency``
  requests sent at once, ``--ignore-eos`` with a fixed output length, sampled
  at the profile's ``decode_temperature`` (greedy decode of the synthetic
  model repeats a few tokens, so concurrent requests would share experts);
* online serving (``online_rates``): requests of mixed input and output lengths
  arriving as a Poisson process at each rate, with TTFT and inter-token latency
  percentiles and request throughput, against a pool whose mixed steps stage;
* for the pool arms, the pool's own counters over each run (hit rate,
  promotions, bytes copied per step, distinct experts per layer and step:
  :func:`pool_counters`, from the lines it logs every ``stats_interval_s``);
* the same with ngram speculative decoding (a second server of the arm), whose
  acceptance comes from the server's ``/metrics`` counters, scraped before and
  after each bench (:func:`acceptance_rate`).

**The pool's counters** come twice, from the two places the series exposes
them: the windows the pool logs (:func:`pool_counters`) and the
``vllm:moe_expert_pool_*`` counters of ``/metrics``, scraped before and after
each bench (:func:`pool_metrics`), so a run shows whether the two agree.

**The budget** is a fraction of the routed-expert bytes. Each arm gets the flags
that keep that fraction on the GPU (:func:`offload_options`): the pool's GiB (its
bank, staging rows and prefill buffers within the budget), UVA's GiB (expert
parameters only), the prefetch offloader's group layout (expert parameters only;
layers are its unit, so its resident share is the nearest it can reach, ties
resolved in its favour). Each server's log gives what it really holds (vLLM's
model-loading and KV-cache lines, the pool's bank and staging lines, the
offloaders' own lines): :func:`server_facts` records them, and
:func:`gpu_expert_bytes` compares all of it, staging included, with the budget.
What each server took of the host's memory, the first thing a user of an offloader
runs out of (UVA and the pool pin it), is read the same way for every arm: memory in
use system-wide just before the server starts and once it is healthy
(:func:`host_taken`).

**An arm that does not start is a result**: its server record says "does not
run", with the exception from the log and the flags it was given, and the
other arms go on. A run cut by the time limit leaves every result written
before it; with a deadline (``--deadline-s``, or the time ``device_run.py`` gives
it: :func:`run_deadline`) it does not start what cannot finish
(:meth:`Runner.fits`) and ends in time to write its summary. Results
are one JSON per run (:func:`harness.results.write`); :func:`summarize` folds
a folder of them into ``summary.json`` and :func:`plot` draws TTFT by arm and
decode tok/s against concurrency.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import shlex
import subprocess
import time
import tomllib
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness import checkpoint, checkpoint_routed, replay, results
from harness.project import REPO, HarnessError, progress

PROFILES = Path(__file__).resolve().parent / "data" / "e2e_profiles.toml"
OFFLOADS = ("none", "pool", "uva", "prefetch")
#: The seconds ``device_run.py`` gives a replay before it sends SIGINT (its
#: ``TIME_LEFT_ENV``; ``tests/test_bundle.py`` checks that the names match).
TIME_LEFT_ENV = "VLLM_BUNDLE_TIME_LEFT_S"
#: What a run keeps back from that time to stop its last server (vLLM's shutdown
#: on SIGTERM) and write its summary.
WIND_DOWN_S = 15.0
#: How long a server or bench gets after SIGTERM before SIGKILL; short, so that a run
#: interrupted by ``device_run.py`` (SIGINT) stops both and writes its summary within
#: that script's kill grace (``harness.device_run.KILL_GRACE_S``).
STOP_TIMEOUT_S = 10.0

#: Lines of a server log that say what each arm holds where.
FACTS = {
    **replay.LOG_FACTS,
    "pool_bank_gib": re.compile(r"Expert pool: .*bank ([\d.]+) GiB"),
    "pool_rows_per_layer": re.compile(
        r"Expert pool: \d+ layers x \d+ experts, (\d+) rows per layer"
    ),
    "pool_staging_buffer_gib": re.compile(r"prefill staging: \d+ x ([\d.]+) GiB device buffers"),
    "pool_staging_buffers": re.compile(r"prefill staging: (\d+) x [\d.]+ GiB device buffers"),
    "uva_offloaded_gib": re.compile(r"Total CPU offloaded parameters: ([\d.]+)"),
    "prefetch_saved_gb": re.compile(r"\[PrefetchOffloader\].*GPU memory saved: ([\d.]+) GB"),
    "prefetch_buffer_gb": re.compile(r"\[PrefetchOffloader\].*Static buffer pool: ([\d.]+) GB"),
    "prefetch_layers": re.compile(r"\[PrefetchOffloader\] Initialized (\d+) modules"),
}

#: The pool's periodic counter line (one window since the previous line; series 0005).
POOL_WINDOW = re.compile(
    r"Expert pool: hit rate [\d.]+% \(lowest layer [\d.]+%\), (\d+) hits, (\d+) misses, "
    r"(\d+) promotions, [\d.]+ GiB copied in the last ([\d.]+) s"
)
#: The lifetime staging total the same line ends with (prefill staging, 0009).
POOL_STAGED = re.compile(r"([\d.]+) GiB staged for (\d+) prefill steps")


def staged_since(before: str, during: str) -> dict[str, float] | None:
    """GiB and prefill steps the pool staged during a bench: the lifetime totals its
    last stats line of ``during`` gives less those of ``before`` (the log up to the
    bench); None when ``during`` has none."""
    after = POOL_STAGED.findall(during)
    if not after:
        return None
    start = POOL_STAGED.findall(before)
    gib0, steps0 = (float(start[-1][0]), int(start[-1][1])) if start else (0.0, 0)
    gib, steps = float(after[-1][0]) - gib0, int(after[-1][1]) - steps0
    return {"gib": round(gib, 2), "steps": steps}


# --- profiles -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measure:
    """What every arm measures (see the profile file's comments)."""

    warmup_input_len: int = 2048
    ttft_input_lens: tuple[int, ...] = (12500, 81600)
    decode_input_len: int = 128
    decode_output_len: int = 256
    decode_concurrency: tuple[int, ...] = (1, 4, 16, 32)
    spec_tokens: int = 3
    spec_concurrency: tuple[int, ...] = (1, 4)
    # Arms that differ from another only in prefill: TTFT and online runs, no decode.
    prefill_only_arms: tuple[str, ...] = ()
    # VLLM_LOG_STATS_INTERVAL for every arm: the pool logs its counters this often.
    stats_interval_s: float = 0.5
    # Sampling temperature of the decode and online runs (0: greedy).
    decode_temperature: float = 0.0
    # Online serving: Poisson arrivals at each rate (requests/s) for about
    # online_duration_s, lengths drawn uniformly from the two [low, high] ranges.
    online_rates: tuple[float, ...] = ()
    online_duration_s: float = 120.0
    online_input_lens: tuple[int, int] = (128, 8192)
    online_output_lens: tuple[int, int] = (64, 512)

    def online_prompts(self, rate: float) -> int:
        """The requests of one online run: ``rate`` x ``online_duration_s``, at least 4."""
        return max(4, round(rate * self.online_duration_s))


@dataclasses.dataclass(frozen=True)
class Arm:
    """One way of holding the experts: ``offload`` plus its own knobs."""

    name: str
    offload: str
    prefill_staging: bool | None = None
    admission: str | None = None  # the pool's --moe-expert-pool-admission (None: default)
    prefetch_step: int = 1
    # The pool's --moe-expert-pool-rows instead of the budget in GiB (None: the budget).
    rows: int | None = None


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    description: str
    preset: str
    routers: tuple[str, ...]
    budget: float
    server: Mapping[str, Any]
    arms: Mapping[str, Arm]
    measure: Measure
    startup_timeout_s: float = 600.0
    bench_timeout_s: float = 600.0
    # What a deadline assumes a server start needs before this run has one of its own.
    startup_floor_s: float = 0.0

    def checkpoint_spec(self, experts: int | None = None) -> checkpoint.Spec:
        spec = checkpoint_routed.PRESETS[self.preset]
        return dataclasses.replace(spec, experts=experts) if experts else spec


#: The keys of a profile's table; its ``server``, ``arms`` and ``measure`` tables are
#: checked by :class:`Arm` and :class:`Measure`.
PROFILE_KEYS = frozenset({
    "description", "preset", "routers", "budget", "server", "arms", "measure",
    "startup_timeout_s", "bench_timeout_s", "startup_floor_s",
})  # fmt: skip


def load_profiles(path: Path = PROFILES) -> dict[str, Profile]:
    """Every e2e profile in ``path``, checked (unknown keys, arms and offloads are errors)."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HarnessError(f"cannot read {path}: {exc}") from exc
    profiles = {}
    for name, body in data.items():
        if not isinstance(body, dict):
            raise HarnessError(f"{path}: {name} = {body!r} is not a profile table")
        unknown = sorted(set(body) - PROFILE_KEYS)
        if unknown:
            raise HarnessError(
                f"{path}: profile {name}: unknown keys {unknown}; known: {sorted(PROFILE_KEYS)}"
            )
        try:
            fields: dict[str, Any] = {
                k: tuple(v) if isinstance(v, list) else v for k, v in body["measure"].items()
            }
            measure = Measure(**fields)
            arms = {arm: Arm(arm, **opts) for arm, opts in body["arms"].items()}
            profile = Profile(
                name=name,
                description=body.get("description", ""),
                preset=body["preset"],
                routers=tuple(body["routers"]),
                budget=float(body["budget"]),
                server=body["server"],
                arms=arms,
                measure=measure,
                startup_timeout_s=float(body.get("startup_timeout_s", 600)),
                bench_timeout_s=float(body.get("bench_timeout_s", 600)),
                startup_floor_s=float(body.get("startup_floor_s", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise HarnessError(f"{path}: profile {name}: {exc}") from exc
        bad = [a.name for a in arms.values() if a.offload not in OFFLOADS]
        if bad or profile.preset not in checkpoint_routed.PRESETS or not 0 < profile.budget < 1:
            raise HarnessError(
                f"{path}: profile {name}: offload must be one of {OFFLOADS} (arms {bad}), "
                f"preset one of {sorted(checkpoint_routed.PRESETS)}, budget in (0, 1)"
            )
        for router in profile.routers:
            if router not in checkpoint_routed.ROUTERS:
                raise HarnessError(f"{path}: profile {name}: unknown router {router!r}")
        profiles[name] = profile
    return profiles


# --- the budget -----------------------------------------------------------------------------------


def prefetch_layout(layers: int, budget: float) -> tuple[int, int, int]:
    """``(group_size, num_in_group, resident_layers)`` nearest ``budget`` of layers resident.

    vLLM's prefetch offloader offloads the last ``num_in_group`` layers of every
    group of ``group_size``. Of the layouts whose resident count is nearest
    ``budget * layers``, the one with more resident layers wins (the
    alternative is not handicapped), then the smallest group (offloaded layers
    interleaved with resident ones, whose compute hides their copies).
    """
    target = budget * layers
    best: tuple[float, int, int, int, int] | None = None
    for group in range(2, layers + 1):
        for num in range(1, group):
            offloaded = sum(1 for i in range(layers) if i % group >= group - num)
            resident = layers - offloaded
            key = (abs(resident - target), -resident, group, num, resident)
            if best is None or key < best:
                best = key
    assert best is not None
    return best[2], best[3], best[4]


def offload_options(arm: Arm, spec: checkpoint.Spec, budget: float) -> dict[str, Any]:
    """``ServerOptions`` fields and facts that put ``budget`` of the expert bytes on the GPU.

    The pool gets ``--moe-expert-pool-gb`` (rounded down to 0.001 GiB), which counts
    everything it keeps on the GPU: its bank, staging rows included, and with prefill
    staging on its prefill staging buffers (series 0009; one of them borrows the bank's
    staging rows from 0017 on, when there is one per expert).
    """
    total = checkpoint_routed.expert_bytes(spec)
    if arm.offload == "none":
        return {"fields": {}, "resident_expert_fraction": 1.0}
    if arm.offload == "pool":
        size: dict[str, Any]
        if arm.rows is not None:
            size = {"moe_expert_pool_rows": arm.rows}
        else:
            size = {"moe_expert_pool_gb": math.floor(budget * total / 2**30 * 1000) / 1000}
        fields: dict[str, Any] = dict(size)
        if arm.prefill_staging is not None:
            fields["prefill_staging"] = arm.prefill_staging
        if arm.admission is not None:
            fields["moe_expert_pool_admission"] = arm.admission
        return {"fields": fields, **size}
    if arm.offload == "uva":
        gib = round((1 - budget) * total / 2**30, 3)
        return {
            "fields": {
                "extra_args": ("--cpu-offload-gb", str(gib), "--cpu-offload-params", "experts")
            },
            "resident_expert_fraction": 1 - gib * 2**30 / total,
        }
    group, num, resident = prefetch_layout(spec.layers, budget)
    return {
        "fields": {
            "extra_args": (
                "--offload-backend",
                "prefetch",
                "--offload-group-size",
                str(group),
                "--offload-num-in-group",
                str(num),
                "--offload-prefetch-step",
                str(arm.prefetch_step),
                "--offload-params",
                "experts",
            )
        },
        "resident_expert_fraction": resident / spec.layers,
        "prefetch_buffer_expert_fraction": arm.prefetch_step / spec.layers,
    }


def bench_seed(run: str) -> int:
    """The request seed of one kind of bench run (``"decode-c32"``, ``"online-r0.3"``).

    It depends on the run alone, not on the arm, router, flags or the run's place in
    the list, so every arm and every later call (``--no-ttft``, ``--online-rates``...)
    sends the same prompts and lengths for it and their results compare request for
    request.
    """
    return zlib.crc32(run.encode()) % 1_000_000 + 1


def server_options(
    profile: Profile, arm: Arm, spec: checkpoint.Spec, speculative: bool
) -> replay.ServerOptions:
    fields = {**profile.server, **offload_options(arm, spec, profile.budget)["fields"]}
    if speculative:
        fields["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": profile.measure.spec_tokens,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
    return replay.ServerOptions(**fields)


def server_facts(log_text: str) -> dict[str, list[float]]:
    """Every :data:`FACTS` value in a server log (one per worker)."""
    return replay.log_facts(log_text, FACTS)


#: vLLM's attention-backend choice (chosen, or named by --attention-backend), and
#: FlashAttention's version.
ATTENTION = re.compile(
    r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention backend out of|backend\.)"
)
FA_VERSION = re.compile(r"Using FlashAttention version (\d+)")


def argv_attention(argv: Sequence[str]) -> str:
    """The backend a server command line asks for (results from before servers
    recorded what their log says), or ``default (not logged)``."""
    if "--attention-backend" in argv:
        return argv[list(argv).index("--attention-backend") + 1]
    return "default (not logged)"


#: The flags that size the pool: rows per layer, or the bank's GiB.
POOL_SIZE_FLAGS = ("--moe-expert-pool-rows", "--moe-expert-pool-gb")


def pool_flag(argv: Sequence[str]) -> str | None:
    """The flag and value that sized the pool on a server command line
    (``--moe-expert-pool-rows 32``), or None where it started no pool."""
    for flag, value in itertools.pairwise(argv):
        if flag in POOL_SIZE_FLAGS:
            return f"{flag} {value}"
    return None


def attention_backend(log_text: str) -> str:
    """The attention backend a server log says it used (``FLASH_ATTN (FA3)``), or
    ``not logged``."""
    found = ATTENTION.findall(log_text)
    if not found:
        return "not logged"
    version = FA_VERSION.findall(log_text)
    return str(found[-1]) + (f" (FA{version[-1]})" if version else "")


#: A server record's host-memory fields (:func:`host_taken`), copied to its summary row;
#: records written before servers measured it lack them (not measured).
HOST_FIELDS = ("host_used_before_start", "host_used_healthy", "host_gib_taken")


def host_taken(before: int | None, healthy: int | None) -> dict[str, Any]:
    """What a server took of the host's memory: the system-wide bytes in use
    (:func:`harness.replay.host_used_bytes`, ``MemTotal - MemAvailable``, pinned pages
    included) just before its process started and once it answered ``/health`` (model
    loaded, before any bench), and their difference in GiB (3 places); None where
    either reading is missing (``/proc/meminfo`` unreadable, or never healthy)."""
    taken = None if before is None or healthy is None else round((healthy - before) / 2**30, 3)
    return {
        "host_used_before_start": before,
        "host_used_healthy": healthy,
        "host_gib_taken": taken,
    }


# --- the runner -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Runner:
    """Every (router, arm) of a profile; all effects go through ``vllm`` and ``results``."""

    profile: Profile
    out: Path
    vllm: Sequence[str]
    models: Mapping[str, str]  # router -> checkpoint folder
    spec: checkpoint.Spec
    arms: Sequence[str]
    routers: Sequence[str]
    speculative: bool = True
    plain: bool = True  # False: only the speculative-decoding servers
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    dry_run: bool = False
    nvml: Any | None = None
    sample_interval_s: float = 0.5
    provenance: Callable[[], dict[str, Any]] = dataclasses.field(
        default_factory=lambda: results.provenance
    )
    echo: Callable[[str], None] = print
    written: list[Path] = dataclasses.field(default_factory=list)
    deadline: float | None = None  # a ``clock()`` value the run must end by; None: no limit
    clock: Callable[[], float] = time.monotonic
    startups: list[float] = dataclasses.field(default_factory=list)  # server starts, s
    # Host memory in use system-wide, bytes (None: unreadable); read around each start.
    host_used: Callable[[], int | None] = replay.host_used_bytes

    def fits(self, what: str, need_s: float) -> bool:
        """Whether ``what``, which takes at least ``need_s`` seconds, can end before the
        deadline; when it cannot, says so (the run then skips it, and :func:`summarize`
        lists its results as not measured). A decode bench's ``need_s`` comes from this
        server's earlier benches (:func:`step_bound_s`), below what they measured; a
        server's is the fastest successful start in this run (a start from a cold page
        cache is the slowest), or the profile's ``startup_floor_s`` before the first."""
        return fits(self.deadline, self.clock(), what, need_s)

    def sessions(self) -> list[tuple[str, Arm, bool]]:
        """``(router, arm, speculative)`` of every server this run starts, in order."""
        out = []
        for router in self.routers:
            for name in self.arms:
                arm = self.profile.arms[name]
                if self.plain:
                    out.append((router, arm, False))
                if self.speculative and name not in self.profile.measure.prefill_only_arms:
                    out.append((router, arm, True))
        return out

    def _names(self, router: str, arm: Arm, speculative: bool) -> list[str]:
        """The result files (without ``.json``) one server session writes when it completes."""
        tag = f"{router}-{arm.name}{'-ngram' if speculative else ''}"
        runs = self._runs(router, arm, speculative)
        return [f"server-{tag}"] + [
            r.result_file.removesuffix(".json") for k, r in runs if k != "warmup"
        ]

    def run(self) -> list[Path]:
        """Every session in order. One whose results all exist is skipped (a later call
        resumes where a cut one stopped); the plan is recorded first, so that
        :func:`summarize` can name what was planned and never measured."""
        if not self.dry_run:
            plan = [
                {"router": r, "arm": a.name, "speculative": sp, "results": self._names(r, a, sp)}
                for r, a, sp in self.sessions()
            ]
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            self._record(f"plan-{stamp}", "e2e-plan", {"sessions": plan}, [], None)
        for router, arm, speculative in self.sessions():
            names = self._names(router, arm, speculative)
            if not self.dry_run and all((self.out / f"{n}.json").exists() for n in names):
                progress(f"{router}/{arm.name}: every result exists in {self.out}; skipped")
                continue
            # The fastest start of this run so far bounds the next one from below;
            # before the first, the profile's floor (each replay is a process of its own).
            need = min(self.startups, default=self.profile.startup_floor_s)
            if not self.dry_run and not self.fits(f"{router}/{arm.name} server", need):
                continue
            self._session(router, arm, speculative)
        return self.written

    def _runs(self, router: str, arm: Arm, speculative: bool) -> list[tuple[str, replay.BenchRun]]:
        m = self.profile.measure
        raw = self.out / "raw"
        tag = f"{router}-{arm.name}{'-ngram' if speculative else ''}"
        meta = {"profile": self.profile.name, "arm": arm.name, "router": router}

        def where(kind: str, suffix: str = "") -> tuple[int, Path, str, dict[str, str]]:
            # The request seed follows the run alone; the result file names the server too.
            return bench_seed(kind + suffix), raw, f"{kind}-{tag}{suffix}.json", meta

        runs = [("warmup", replay.BenchRun(m.warmup_input_len, 16, 1, *where("warmup")))]
        if not speculative:
            for n in m.ttft_input_lens:
                runs.append(("ttft", replay.BenchRun(
                    n, 16, 1, *where("ttft", f"-in{n}"), run=1
                )))  # fmt: skip
        if arm.name not in m.prefill_only_arms:
            for c in m.spec_concurrency if speculative else m.decode_concurrency:
                runs.append(("decode", replay.BenchRun(
                    m.decode_input_len, m.decode_output_len, c, *where("decode", f"-c{c}"),
                    run=1, concurrency=c,
                    temperature=m.decode_temperature,
                )))  # fmt: skip
        if not speculative:
            input_len, input_ratio = replay.length_range(*m.online_input_lens)
            output_len, output_ratio = replay.length_range(*m.online_output_lens)
            for rate in m.online_rates:
                prompts = m.online_prompts(rate)
                runs.append(("online", replay.BenchRun(
                    input_len, output_len, prompts, *where("online", f"-r{rate:g}"),
                    run=1, concurrency=prompts,
                    temperature=m.decode_temperature, request_rate=rate,
                    range_ratio=(input_ratio, output_ratio),
                )))  # fmt: skip
        return runs

    def _session(self, router: str, arm: Arm, speculative: bool) -> None:
        options = server_options(self.profile, arm, self.spec, speculative)
        port = 8000 if self.dry_run else replay.free_port()
        argv = replay.serve_argv(self.vllm, options, self.models[router], port)
        tag = f"{router}-{arm.name}{'-ngram' if speculative else ''}"
        log = self.out / "logs" / f"{tag}.server.log"
        if not self.dry_run:
            keep_earlier_start(self.out, tag)
        server = replay.Server(argv, port, log, self.env, stop_timeout_s=STOP_TIMEOUT_S)
        runs = self._runs(router, arm, speculative)
        if self.dry_run:
            self.echo(shlex.join(argv))
            for _, run in runs:
                self.echo(shlex.join(replay.bench_argv(self.vllm, self.models[router], port, run)))
            return
        budget = offload_options(arm, self.spec, self.profile.budget)
        budget.pop("fields")
        common = {
            "arm": arm.name,
            "offload": arm.offload,
            "router": router,
            "speculative": {"method": "ngram", "tokens": self.profile.measure.spec_tokens}
            if speculative else None,
            "budget": {"fraction": self.profile.budget, **budget},
        }  # fmt: skip
        # The same reading for every arm: the host's memory in use just before the
        # server's process starts and once it is healthy (:func:`host_taken`).
        host_before = self.host_used()
        started = self.clock()
        with server:
            state = server.wait_healthy(self.profile.startup_timeout_s)
            startup_s = round(self.clock() - started, 1)
            host = host_taken(host_before, self.host_used() if state == "ok" else None)
            if state == "ok":
                self.startups.append(startup_s)
            text = server.log.read_text(errors="replace") if server.log.exists() else ""
            record = {
                **common,
                "outcome": "runs" if state == "ok" else "does not run",
                "startup_s": startup_s,
                "facts": server_facts(text),
                "attention_backend": attention_backend(text),
                **host,
                "server_log": str(server.log),
            }
            if state != "ok":
                outcome, message = replay.classify_failure(text)
                record.update(state=state, failure=outcome, exception=message,
                              log_tail=server.log_tail(60))  # fmt: skip
            self._record(f"server-{tag}", "e2e-server", record, server.argv, None)
            if state != "ok":
                progress(f"{tag}: server did not start ({state}); next arm")
                return
            # Lower bounds of this server's decode step, by the concurrency they were
            # measured at (0: the warm-up's one greedy request, which routes to the
            # fewest experts): a step at c requests is no faster than one at fewer
            # (:func:`step_bound_s`). A speculative step streams at most 1 + k tokens.
            steps: dict[int, float] = {}
            per_step = 1 + self.profile.measure.spec_tokens if speculative else 1
            for kind, run in runs:
                done = self.out / run.result_file
                if kind != "warmup" and done.exists():
                    progress(f"{done.name} exists; not measured again")
                    continue
                need = 0.0
                if kind == "decode":
                    step = max((v for c, v in steps.items() if c <= run.concurrency), default=0)
                    need = step * (run.output_len - 1) / per_step
                elif kind == "online" and run.request_rate:
                    need = run.prompts / run.request_rate  # the arrivals alone
                if not self.fits(run.result_file.removesuffix(".json"), need):
                    continue
                bench = self._bench(kind, run, router, server, common)
                if kind in ("decode", "warmup"):
                    steps[run.concurrency if kind == "decode" else 0] = step_bound_s(bench)

    def _bench(
        self,
        kind: str,
        run: replay.BenchRun,
        router: str,
        server: replay.Server,
        common: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Runs one bench and records it (not the warm-up); returns ``vllm bench serve``'s
        result, or ``{}`` when it failed."""
        argv = replay.bench_argv(self.vllm, self.models[router], server.port, run)
        sampler = replay.NvmlSampler(self.nvml, self.sample_interval_s) if self.nvml else None
        if sampler:
            sampler.start()
        progress("$ " + shlex.join(argv))
        log_start = server.log.stat().st_size if server.log.exists() else 0
        pooled = common["offload"] == "pool" and kind != "warmup"
        pool_before = replay.scrape_metrics(server.url, POOL_METRICS) if pooled else None
        spec_before = (
            replay.scrape_spec_decode(server.url)
            if common["speculative"] and kind != "warmup"
            else None
        )
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code: int | str = proc.wait(timeout=self.profile.bench_timeout_s)
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:
            replay.stop_group(proc, STOP_TIMEOUT_S)
            samples = sampler.stop() if sampler else []
        path = run.result_dir / run.result_file
        bench = json.loads(path.read_text()) if code == 0 and path.exists() else {}
        if kind == "warmup":
            return bench
        ok = code == 0 and bench.get("completed") == run.prompts and not bench.get("failed")
        data = {
            **common,
            "input_len": run.input_len,
            "output_len": run.output_len,
            "concurrency": run.concurrency,
            "temperature": run.temperature,
            "prompts": run.prompts,
            "request_rate": run.request_rate,
            "range_ratio": list(run.range_ratio) if run.range_ratio else None,
            "bench_seed": run.seed,
            "outcome": "ok" if ok else f"failed ({code})",
            "summary": replay.summarize_bench(bench, run.output_len) if bench else None,
            "nvml": {
                "available": self.nvml is not None,
                "interval_s": self.sample_interval_s,
                "summary": replay.summarize_samples(samples),
                "by_phase": {
                    phase: replay.summarize_samples(replay.in_windows(samples, windows))
                    for phase, windows in replay.phases(bench).items()
                } if bench else {},
            },
            "bench": bench,
        }  # fmt: skip
        if pool_before is not None:
            data["pool_metrics"] = pool_metrics(
                pool_before, replay.scrape_metrics(server.url, POOL_METRICS)
            )
        if common["offload"] == "pool":
            whole = server.log.read_bytes()
            before = whole[:log_start].decode(errors="replace")
            text = whole[log_start:].decode(errors="replace")
            tokens = run.output_len * run.prompts
            if kind == "online":  # lengths drawn per request
                tokens = int(bench.get("total_output_tokens") or tokens)
            data["pool_counters"] = pool_counters(
                text,
                self.spec,
                tokens,
                steps=None if common["speculative"] or kind == "online" else run.output_len,
            )
            data["pool_staged"] = staged_since(before, text)
        if spec_before is not None:
            after = replay.scrape_spec_decode(server.url)
            if after is not None:
                data["spec_decode"] = replay.spec_decode_delta(spec_before, after)
        name = run.result_file.removesuffix(".json")
        self._record(name, f"e2e-{kind}", data, server.argv, argv)
        return bench

    def _record(
        self,
        name: str,
        kind: str,
        data: dict[str, Any],
        server_argv: list[str],
        bench: list[str] | None,
    ) -> None:
        prov = self.provenance()
        prov["server_argv"] = server_argv
        prov["bench_argv"] = bench
        prov["env"] = {**replay.server_env(os.environ), **self.env}
        record = {"profile": self.profile.name, "checkpoint": dataclasses.asdict(self.spec), **data}
        path = results.write(self.out / f"{name}.json", kind, record, prov)
        self.written.append(path)
        progress(f"wrote {path}")


#: The share of an earlier bench's median inter-token latency that :func:`step_bound_s`
#: counts per decode step of a later one. A bench of n tokens lasts its process start-up,
#: its first token and n - 1 mean ITLs. In results/e2e a later bench's mean ITL was
#: 0.99-1.02x the earlier median where a step took about 0.5 s (the prefetch
#: offloader), and down to 0.74x where it took 5-7 ms (a warm-up's 2048-token context
#: against 128, accepted ngram drafts), where the whole bound is about a second, less
#: than a bench's own start-up.
STEP_BOUND_SHARE = 0.9


def step_bound_s(bench: Mapping[str, Any]) -> float:
    """A lower bound of one decode step of a later bench at as many requests or more, in
    seconds, from a ``vllm bench serve`` result: :data:`STEP_BOUND_SHARE` of its median
    time between streamed outputs (of its median TPOT where it has no ITL); 0 when it
    has neither."""
    ms = bench.get("median_itl_ms") or bench.get("median_tpot_ms") or 0.0
    return STEP_BOUND_SHARE * float(ms) / 1000


def pool_counters(
    log_text: str, spec: checkpoint.Spec, output_tokens: int, steps: int | None
) -> dict[str, Any] | None:
    """The pool's counters over one bench: the sum of the windows it logged meanwhile.

    The pool logs a window once per ``VLLM_LOG_STATS_INTERVAL`` when a step runs, so
    the last part of a bench (at most one interval) is counted in the next one's
    first window. Hits and misses are distinct routed experts per layer and decode
    step; each miss copies one expert, whose bytes are the checkpoint's bytes per
    expert. ``steps`` is the decode steps of the bench when known (requests sent at
    once without speculation decode in lockstep: their output length).
    """
    windows = [tuple(float(g) for g in m.groups()) for m in POOL_WINDOW.finditer(log_text)]
    if not windows:
        return None
    hits, misses, promotions = (int(sum(w[i] for w in windows)) for i in range(3))
    copied = misses * checkpoint_routed.bytes_per_expert(spec)
    return {
        "windows": len(windows),
        "window_s": round(sum(w[3] for w in windows), 2),
        "hits": hits,
        "misses": misses,
        "promotions": promotions,
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "gib_copied": round(copied / 2**30, 3),
        "mib_per_output_token": round(copied / 2**20 / output_tokens, 2) if output_tokens else None,
        "mib_per_step": round(copied / 2**20 / steps, 2) if steps else None,
        # Distinct routed experts per layer and step: top_k for one request, more as
        # concurrent requests route apart (top_k x requests when none share one).
        "experts_per_layer_step": round((hits + misses) / (spec.layers * steps), 2)
        if steps
        else None,
    }


POOL_METRICS = "vllm:moe_expert_pool_"


def pool_metrics(
    before: Mapping[str, float], after: Mapping[str, float] | None
) -> dict[str, Any] | None:
    """The pool's ``/metrics`` counters over one bench, summed over layers.

    The same counters as :func:`pool_counters` reads from the log, exported by the
    series as ``vllm:moe_expert_pool_{hits,misses,promotions,copied_bytes}_total``
    (summed over the pooled layers; earlier versions of the series exported one
    series per layer, which ``layers`` counts; None for the summed form), plus the
    ``route_error`` gauge after the bench; scraped before and
    after the bench, so nothing of the previous run leaks in (the worker attaches a
    snapshot at most once per ``VLLM_LOG_STATS_INTERVAL``: the last interval of a
    bench may be missing). ``None`` when the second scrape failed.
    """
    if after is None:
        return None

    def total(name: str, source: Mapping[str, float]) -> float:
        return sum(v for k, v in source.items() if k.partition("{")[0] == POOL_METRICS + name)

    delta = {
        name: int(total(f"{name}_total", after) - total(f"{name}_total", before))
        for name in ("hits", "misses", "promotions", "copied_bytes")
    }
    seen = delta["hits"] + delta["misses"]
    per_layer = [k for k in after if k.startswith(POOL_METRICS + "hits_total{") and 'layer="' in k]
    return {
        **delta,
        "hit_rate": round(delta["hits"] / seen, 4) if seen else None,
        "route_error": total("route_error", after),
        "layers": len(per_layer) or None,
    }


#: How far above the budget (a share of it) what an arm keeps of the experts on the GPU
#: may be for the arm to hold the budget; keeping less always holds it.
BUDGET_TOLERANCE = 0.02


def over_budget(row: Mapping[str, Any]) -> float:
    """How far a server row's ``expert_gib_on_gpu``, staging included, is above its
    ``budget_gib``, as a share of the budget (negative: below it)."""
    return float(row["expert_gib_on_gpu"]) / float(row["budget_gib"]) - 1


def gpu_expert_bytes(data: Mapping[str, Any], spec: checkpoint.Spec) -> dict[str, Any]:
    """What a server really keeps of the experts on the GPU, from its own log lines.

    vLLM's "Model loading took X GiB" covers every weight (and the pool's bank
    and prefill buffers, which are allocated during loading); minus the
    non-expert weights it is the expert bytes on the GPU. The prefetch
    offloader allocates its static buffers after that line (it logs them on the
    next one, and its resident layers alone make up the loading figure), so
    they are added. All of it, staging included, is what a user must have free
    on the GPU for the arm, so all of it compares with the budget:
    ``holds_budget`` is at most :data:`BUDGET_TOLERANCE` above it (:func:`over_budget`;
    None for the reference, which has no budget). ``staging_gib`` (the pool's
    per-step rows and prefill buffers, the prefetch offloader's static buffers)
    says how much of it is staging; it excuses none of it.
    """
    facts = data["facts"]
    loading = facts.get("model_loading_gib") or []
    if not loading:
        return {"expert_gib_on_gpu": None, "staging_gib": None, "holds_budget": None}
    on_gpu = loading[0] - checkpoint_routed.other_bytes(spec) / 2**30
    row_gib = checkpoint_routed.bytes_per_expert(spec) / 2**30
    staging = 0.0
    if facts.get("pool_bank_gib") and facts.get("pool_rows_per_layer"):
        cache_rows = facts["pool_rows_per_layer"][0] * spec.layers
        staging += facts["pool_bank_gib"][0] - cache_rows * row_gib
        staging += (facts.get("pool_staging_buffers") or [0])[0] * (
            facts.get("pool_staging_buffer_gib") or [0]
        )[0]
    prefetch_buffers = (facts.get("prefetch_buffer_gb") or [0])[0] * 1e9 / 2**30
    on_gpu += prefetch_buffers
    staging += prefetch_buffers
    budget_gib = data["budget"]["fraction"] * checkpoint_routed.expert_bytes(spec) / 2**30
    row = {
        "expert_gib_on_gpu": round(on_gpu, 3),
        "staging_gib": round(staging, 3),
        "budget_gib": round(budget_gib, 3),
    }
    held = None if data["offload"] == "none" else over_budget(row) <= BUDGET_TOLERANCE
    return {**row, "holds_budget": held}


# --- summary and plots ----------------------------------------------------------------------------


def keep_earlier_start(out: Path, tag: str) -> None:
    """Before a session resumes in ``out`` (a later call going on where a cut one
    stopped), moves the earlier start's server log and record to
    ``logs/TAG.server-N.log`` and ``logs/server-TAG-N.json`` (N = 1, 2, ...: the
    first free), where the new start would overwrite them; the summary reads the
    newest start's record only."""
    logs = out / "logs"
    earlier = [(logs / f"{tag}.server.log", "{tag}.server-{n}.log"),
               (out / f"server-{tag}.json", "server-{tag}-{n}.json")]  # fmt: skip
    if not any(path.exists() for path, _ in earlier):
        return
    n = 1
    while any((logs / name.format(tag=tag, n=n)).exists() for _, name in earlier):
        n += 1
    logs.mkdir(parents=True, exist_ok=True)
    for path, name in earlier:
        if path.exists():
            path.rename(logs / name.format(tag=tag, n=n))


def _records(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob("*.json")):
        if path.name == "summary.json":
            continue
        record = json.loads(path.read_text())
        if str(record.get("kind", "")).startswith("e2e-"):
            out.append(record)
    return out


def acceptance_rate(data: Mapping[str, Any]) -> float | None:
    """The ngram acceptance rate of one decode run, over that run alone.

    From the ``/metrics`` counters scraped just before and after the bench
    (``spec_decode``). Result files written before the runner scraped per bench
    hold only counters since the server started (``spec_decode_since_start``,
    which include the warm-up's greedy tokens and earlier benches); for those,
    ``vllm bench serve``'s own figure, which covers the bench alone, is used.
    """
    if "spec_decode" in data:
        rate: float | None = data["spec_decode"].get("acceptance_rate")
        return rate
    pct = (data.get("summary") or {}).get("spec_decode_acceptance_rate_pct")
    return None if pct is None else pct / 100


#: Fewest completed requests whose p99 a table shows; below it a p99 is about the worst
#: request (of 12 requests, the maximum), so tables show the p90.
P99_MIN_REQUESTS = 100


def tail_latency(row: Mapping[str, Any], metric: str) -> tuple[str, float | None]:
    """The tail percentile of ``metric`` (``ttft_s``, ``itl_ms``) an online row's number of
    completed requests supports: ``("p99", value)`` from :data:`P99_MIN_REQUESTS` on,
    else ``("p90", value)`` (None where the run did not record it)."""
    name = "p99" if (row.get("completed") or 0) >= P99_MIN_REQUESTS else "p90"
    return name, row.get(f"{metric}_{name}")


def online_row(row: Mapping[str, Any], data: Mapping[str, Any]) -> dict[str, Any]:
    """One online run's summary row: latency percentiles (TTFT in s, inter-token in ms)
    and throughput from ``vllm bench serve``'s result, and the pool's hit rate and
    staging over the run."""
    bench = data.get("bench") or {}

    def seconds(key: str) -> float | None:
        return bench[key] / 1000 if key in bench else None

    return {
        **row,
        "request_rate": data["request_rate"],
        "prompts": data.get("prompts"),
        "completed": bench.get("completed"),
        "ttft_s_p50": seconds("p50_ttft_ms"),
        "ttft_s_p90": seconds("p90_ttft_ms"),
        "ttft_s_p99": seconds("p99_ttft_ms"),
        "itl_ms_p50": bench.get("p50_itl_ms"),
        "itl_ms_p90": bench.get("p90_itl_ms"),
        "itl_ms_p99": bench.get("p99_itl_ms"),
        "request_throughput": bench.get("request_throughput"),
        "output_throughput": bench.get("output_throughput"),
        "pool_hit_rate": (data.get("pool_counters") or {}).get("hit_rate"),
        "pool_staged_gib": (data.get("pool_staged") or {}).get("gib"),
    }


def summarize(folder: Path) -> dict[str, Any]:
    """``summary.json``: decode, TTFT and online rows, the servers' outcomes, and the
    provenance.

    The provenance is the first result's (each file keeps its own); the rows are
    at the top level, for anyone comparing a later series with this one.
    """
    decode, ttft, online, servers = [], [], [], []
    planned: set[str] = set()
    present = {p.stem for p in folder.glob("*.json")}
    provenance: dict[str, Any] = {}
    budget = None
    spec: checkpoint.Spec | None = None
    for record in _records(folder):
        data = record["data"]
        provenance = provenance or {
            k: v for k, v in record["provenance"].items() if k not in ("server_argv", "bench_argv")
        }
        if record["kind"] == "e2e-plan":
            planned.update(n for session in data["sessions"] for n in session["results"])
            continue
        spec_tokens = (data.get("speculative") or {}).get("tokens", 0)
        if record["kind"] == "e2e-server":
            budget = budget or data["budget"]["fraction"]
            spec = checkpoint.Spec(**record["data"]["checkpoint"])
            argv = record["provenance"].get("server_argv") or []
            servers.append({
                "arm": data["arm"], "router": data["router"], "spec_tokens": spec_tokens,
                "outcome": data["outcome"], "startup_s": data["startup_s"],
                "exception": data.get("exception"), "facts": data["facts"],
                "attention_backend": data.get("attention_backend") or argv_attention(argv),
                # The flag that sized the pool, as it ran (rows, or GiB since the
                # profile's pool arm took --moe-expert-pool-gb).
                "pool_flag": pool_flag(argv),
                **gpu_expert_bytes(data, spec),
                # What the server took of the host's memory; a record from before servers
                # measured it lacks the fields, and so does its row (not measured).
                **{key: data[key] for key in HOST_FIELDS if key in data},
            })  # fmt: skip
            continue
        summary = data.get("summary") or {}
        row = {"arm": data["arm"], "router": data["router"], "outcome": data["outcome"]}
        if record["kind"] == "e2e-decode":
            counters = data.get("pool_counters") or {}
            decode.append({
                **row,
                "concurrency": data["concurrency"],
                "spec_tokens": spec_tokens,
                "output_len": data["output_len"],
                "temperature": data.get("temperature", 0.0),
                "tok_s": summary.get("decode_tok_s"),
                "acceptance_rate": acceptance_rate(data),
                "pool_hit_rate": counters.get("hit_rate"),
                # The same hit rate from the pool's /metrics counters (None before
                # the runner scraped them, or when the scrape failed).
                "pool_metrics_hit_rate": (data.get("pool_metrics") or {}).get("hit_rate"),
                "pool_mib_per_step": counters.get("mib_per_step"),
            })  # fmt: skip
        elif record["kind"] == "e2e-ttft":
            ttft.append(
                {**row, "input_len": data["input_len"], "ttft_s": summary.get("ttft_s_mean")}
            )
        elif record["kind"] == "e2e-online":
            online.append(online_row(row, data))
    # Each bench row names the attention backend of the server it measured.
    backends = {(s["arm"], s["router"], s["spec_tokens"]): s["attention_backend"] for s in servers}
    for bench_row in decode + ttft + online:
        key = (bench_row["arm"], bench_row["router"], bench_row.get("spec_tokens", 0))
        bench_row["attention_backend"] = backends.get(key, "no server record")
    spec = None
    if budget is not None:
        first = next(r for r in _records(folder) if r["kind"] == "e2e-server")
        spec = (
            checkpoint.Spec(**first["data"]["checkpoint"])
            if "checkpoint" in first["data"]
            else None
        )
    return {
        "schema": results.SCHEMA,
        "kind": "e2e-summary",
        "decode": decode,
        "ttft": ttft,
        "online": online,
        "servers": servers,
        # Planned by a run and never written: cut by a time limit, or after a failed server.
        "not_measured": sorted(planned - present),
        "budget_fraction": budget,
        "budget_gib": round(budget * checkpoint_routed.expert_bytes(spec) / 2**30, 3)
        if spec and budget
        else None,
        "provenance": provenance,
    }


def summarize_runs(folders: Sequence[Path]) -> dict[str, Any]:
    """One summary over several run folders (``results/e2e/summary.json``).

    Every row gains ``run`` (the folder's name), ``series_hash`` (the series it
    measured) and ``base`` (the vLLM release under it): runs of different series,
    releases or leases sit side by side but are never merged. ``provenance`` is the
    newest run's; ``runs`` holds each run's.
    """
    out: dict[str, Any] = {"schema": results.SCHEMA, "kind": "e2e-summary"}
    rows: dict[str, list[dict[str, Any]]] = {"decode": [], "ttft": [], "online": [], "servers": []}
    runs, missing, budgets = {}, [], set()
    for folder in folders:
        one = summarize(folder)
        prov = one["provenance"]
        tag = {
            "run": folder.name,
            "series_hash": prov.get("series_hash"),
            "base": (prov.get("base") or {}).get("version"),
        }
        for key, items in rows.items():
            items += [{**tag, **row} for row in one[key]]
        missing += [f"{folder.name}/{name}" for name in one["not_measured"]]
        runs[folder.name] = one["provenance"]
        budgets.add((one["budget_fraction"], one["budget_gib"]))
    if len(budgets) > 1:
        raise HarnessError(f"runs with different budgets cannot share a summary: {budgets}")
    fraction, gib = budgets.pop() if budgets else (None, None)
    out.update(rows, not_measured=missing, budget_fraction=fraction, budget_gib=gib)
    out.update(provenance=runs[folders[-1].name] if folders else {}, runs=runs)
    return out


def write_summary(root: Path) -> list[Path]:
    """``root/summary.json``, ``root/matrix.md`` and the plots over every run folder under
    ``root`` (a folder with server records), oldest name first; returns the files written."""
    folders = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("server-*.json")))
    if not folders:
        raise HarnessError(f"no e2e run folders under {root}")
    summary = summarize_runs(folders)
    path = root / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    table = root / "matrix.md"
    shown = root.relative_to(REPO) if root.is_relative_to(REPO) else root
    table.write_text(matrix_markdown(summary, shown.as_posix()))
    return [path, table, *plot(summary, root)]


def _run_label(run: str) -> str:
    """``run 9`` for ``2026-12-01-run9-skewed-...``; the name after the date otherwise."""
    if m := re.search(r"-run(\d+)-", run):
        return f"run {m.group(1)}"
    return re.sub(r"^\d{4}-\d{2}-\d{2}-", "", run)


def sig3(value: float) -> str:
    """Three significant digits, trailing zeros kept (1.90, 51.6, 239)."""
    return f"{value:.0f}" if value >= 100 else f"{value:#.3g}"


def newest_rows(
    rows: Sequence[tuple[Any, Mapping[str, Any]]], runs: Mapping[str, Any]
) -> dict[Any, Mapping[str, Any]]:
    """The newest row (by its run's date) of each key of ``(key, row)`` pairs."""
    out: dict[Any, Mapping[str, Any]] = {}
    for key, row in sorted(rows, key=lambda kr: runs.get(kr[1]["run"], {}).get("date", "")):
        out[key] = row
    return out


def newest_configuration(summary: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], bool]:
    """Whether a row of a several-run summary was measured with its arm's newest pool
    size (``pool_flag`` of the newest server of the arm): an arm whose flag changed
    between runs (the pool went from ``--moe-expert-pool-rows 32`` to
    ``--moe-expert-pool-gb 8.859``) shows no older cells beside the newer ones. A run
    without a server record of the arm counts as one without a pool flag."""
    runs = summary.get("runs", {})
    flags = {(r["run"], r["arm"]): r.get("pool_flag") for r in summary["servers"]}
    newest = newest_rows([((r["arm"],), r) for r in summary["servers"]], runs)
    current = {arm: r.get("pool_flag") for (arm,), r in newest.items()}

    def keep(row: Mapping[str, Any]) -> bool:
        arm = row["arm"]
        return arm not in current or flags.get((row["run"], arm)) == current[arm]

    return keep


def newest_cells(summary: Mapping[str, Any]) -> dict[str, dict[Any, Mapping[str, Any]]]:
    """The newest row of each cell of a several-run summary, among the rows of each arm's
    newest configuration (:func:`newest_configuration`): ``servers`` by arm (plain
    servers), ``ttft`` by (router, arm, input length), ``decode`` by (router, arm,
    spec tokens, concurrency) and ``online`` by (router, arm, request rate; completed
    runs). Greedy decode runs (temperature 0) are left out: their repeated tokens make
    requests share experts (results/e2e/README.md)."""
    runs = summary.get("runs", {})
    keep = newest_configuration(summary)
    return {
        "servers": newest_rows(
            [((r["arm"],), r) for r in summary["servers"]
             if not r["spec_tokens"] and r["expert_gib_on_gpu"] is not None and keep(r)],
            runs,
        ),
        "ttft": newest_rows(
            [((r["router"], r["arm"], r["input_len"]), r) for r in summary["ttft"]
             if r["ttft_s"] is not None and keep(r)],
            runs,
        ),
        "decode": newest_rows(
            [((r["router"], r["arm"], r["spec_tokens"], r["concurrency"]), r)
             for r in summary["decode"]
             if r["tok_s"] is not None and r.get("temperature") and keep(r)],
            runs,
        ),
        "online": newest_rows(
            [((r["router"], r["arm"], r["request_rate"]), r) for r in summary.get("online", [])
             if r["outcome"] == "ok" and keep(r)],
            runs,
        ),
    }  # fmt: skip


def matrix_markdown(summary: Mapping[str, Any], source: str = "results/e2e") -> str:
    """Every arm's newest measurement per router, prompt length and concurrency, and what
    its server kept on the GPU (:func:`newest_cells`), as markdown tables
    (``results/e2e/matrix.md``): what a reader choosing an offload flag compares."""
    cells = newest_cells(summary)
    servers, ttft, decode = cells["servers"], cells["ttft"], cells["decode"]
    lens = sorted({k[2] for k in ttft})
    widths = sorted({k[3] for k in decode})

    def cell(row: Mapping[str, Any] | None, key: str) -> str:
        if row is None:
            return "-"
        return f"{sig3(row[key])} ({_run_label(row['run'])}, `{row['series_hash']}`)"

    def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
        return [
            "| " + " | ".join(head) + " |",
            "|" + " --- |" * len(head),
            *("| " + " | ".join(row) + " |" for row in rows),
        ]

    def held(r: Mapping[str, Any]) -> str:
        if r["holds_budget"] is None:
            return "reference"
        return f"{'yes' if r['holds_budget'] else 'no'} ({over_budget(r):+.1%})"

    kept = [
        [arm, f"{r['expert_gib_on_gpu']:.2f} GiB", f"{r['staging_gib']:.2f} GiB", held(r)]
        for (arm,), r in servers.items()
    ]
    ttft_rows = [
        [router, arm, *(cell(ttft.get((router, arm, n)), "ttft_s") for n in lens)]
        for router, arm in dict.fromkeys(k[:2] for k in sorted(ttft))
    ]
    decode_rows = [
        [router, arm + (f", ngram {spec}" if spec else ""),
         *(cell(decode.get((router, arm, spec, c)), "tok_s") for c in widths)]
        for router, arm, spec in dict.fromkeys(k[:3] for k in sorted(decode))
    ]  # fmt: skip
    pooled = [k for k in dict.fromkeys(k[:3] for k in sorted(decode)) if k[1].startswith("pool")]

    def counters(row: Mapping[str, Any] | None) -> str:
        if row is None or row.get("pool_hit_rate") is None:
            return "-"
        mib = row.get("pool_mib_per_step")
        moved = f", {mib / 1024:.2f} GiB per step" if mib is not None else ""
        return f"{row['pool_hit_rate']:.1%}{moved}"

    pool_rows = [
        [router, arm + (f", ngram {spec}" if spec else ""),
         *(counters(decode.get((router, arm, spec, c))) for c in widths)]
        for router, arm, spec in pooled
    ]  # fmt: skip
    budget = f"{summary.get('budget_fraction') or 0:.0%}, {summary.get('budget_gib') or 0:.2f}"

    def tail(r: Mapping[str, Any], metric: str) -> str:
        name, value = tail_latency(r, metric)
        return f"{sig3(r[f'{metric}_p50'])} / {'-' if value is None else sig3(value)} ({name})"

    def served(r: Mapping[str, Any]) -> list[str]:
        staged = r.get("pool_staged_gib")
        return [
            str(r.get("completed", "-")),
            tail(r, "ttft_s"),
            tail(r, "itl_ms"),
            f"{r['request_throughput']:.3f}",
            "-" if staged is None else f"{staged:,.0f}",
            f"{_run_label(r['run'])}, `{r['series_hash']}`",
        ]

    online = cells["online"]
    online_part = [
        "",
        "## Online serving: Poisson arrivals, input and output lengths drawn per request",
        "",
        f"Tails: p99 from {P99_MIN_REQUESTS} completed requests on, else p90. Completed per",
        "second counts the run's drain after the last arrival: it is no capacity.",
        "",
        *table(["router", "arm", "requests/s", "completed", "TTFT p50 / tail, s",
                "inter-token p50 / tail, ms", "completed per second", "GiB staged", "run"],
               [[router, arm, f"{rate:g}", *served(r)]
                for (router, arm, rate), r in sorted(online.items())]),
    ] if online else []  # fmt: skip
    return "\n".join([
        "# The end-to-end matrix: each arm's newest measurement",
        "",
        f"Written by `python -m harness replay e2e --summarize {source}` from",
        "`summary.json`; each cell names its run folder and series hash. Cells of",
        "different runs come from different machine starts or series: README.md says",
        "which share a machine start, and only those give side-by-side ratios.",
        "",
        "## What each arm's server kept on the GPU (vLLM's log)",
        "",
        f"Budget: {budget} GiB of the expert bytes; an arm holds it when everything it",
        "keeps of the experts on the GPU, staging included, is at most "
        f"{BUDGET_TOLERANCE:.0%} above it.",
        "",
        *table(["arm", "experts on the GPU", "of which staging", "held, against the budget"],
               kept),
        "",
        "## TTFT, one request (s)",
        "",
        *table(["router", "arm", *(f"{n:,} tokens" for n in lens)], ttft_rows),
        "",
        "## Decode, sampled, tok/s per request (1000 / mean TPOT)",
        "",
        *table(["router", "arm", *(f"c={c}" for c in widths)], decode_rows),
        "",
        "## The pool's counters in those decode runs: hit rate, bytes copied per step",
        "",
        *table(["router", "arm", *(f"c={c}" for c in widths)], pool_rows),
        *online_part,
    ]) + "\n"  # fmt: skip


def _panels(
    rows: Sequence[Mapping[str, Any]],
    png: Path,
    draw: Callable[[Any, str, list[Mapping[str, Any]]], None],
) -> Path:
    """One panel per router of ``rows``, each drawn by ``draw(ax, router, its rows)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routers = sorted({r["router"] for r in rows})
    fig, axes = plt.subplots(1, len(routers), figsize=(6 * len(routers), 4), squeeze=False)
    for ax, router in zip(axes[0], routers, strict=True):
        ax.set_prop_cycle(color=plt.get_cmap("tab20").colors)  # more runs than 10 colours
        draw(ax, router, [r for r in rows if r["router"] == router])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


#: One colour per arm in every plot, so that panels read alike (others: matplotlib's).
ARM_COLORS = {
    "resident": "tab:gray",
    "pool": "tab:blue",
    "pool-host-view": "tab:cyan",
    "pool-frequency": "tab:green",
    "uva": "tab:purple",
    "prefetch": "tab:orange",
}


def _label(row: Mapping[str, Any]) -> str:
    """The arm, with its run and decode sampling where a summary spans several runs."""
    if "run" not in row:
        return str(row["arm"])
    sampled = ", sampled" if row.get("temperature") else ""
    return f"{row['arm']} [{row['run']}{sampled}]"


def _ttft_panel(ax: Any, router: str, rows: list[Mapping[str, Any]]) -> None:
    lens = sorted({r["input_len"] for r in rows})
    arms = list(dict.fromkeys(_label(r) for r in rows))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        xs, ys = [], []
        for j, n in enumerate(lens):
            hit = [r["ttft_s"] for r in rows if _label(r) == arm and r["input_len"] == n]
            if hit:
                xs.append(j + (i - (len(arms) - 1) / 2) * width)
                ys.append(hit[0])
        name = next(r["arm"] for r in rows if _label(r) == arm)
        bars = ax.bar(xs, ys, width, label=arm, color=ARM_COLORS.get(name))
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(lens)), [f"{n:,} tokens" for n in lens])
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"TTFT, {router} router")


def _decode_panel(ax: Any, router: str, rows: list[Mapping[str, Any]]) -> None:
    for arm, spec_tokens in dict.fromkeys((_label(r), r["spec_tokens"]) for r in rows):
        pts = sorted(
            (r["concurrency"], r["tok_s"])
            for r in rows
            if _label(r) == arm and r["spec_tokens"] == spec_tokens
        )
        label = arm + (f" + ngram {spec_tokens}" if spec_tokens else "")
        style = "--" if spec_tokens else "-"
        name = next(r["arm"] for r in rows if _label(r) == arm)
        ax.plot(*zip(*pts, strict=True), marker="o", ls=style, label=label,
                color=ARM_COLORS.get(name))  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tok/s per request (1000 / mean TPOT)")
    ax.set_title(f"decode, {router} router")


def plot(summary: Mapping[str, Any], folder: Path) -> list[Path]:
    """``ttft.png`` (TTFT by arm and prompt length) and ``decode.png`` (one panel per router).

    A several-run summary draws each arm's newest value per cell (:func:`newest_cells`,
    the points of ``matrix.md``, which names the run of each); one run draws its rows.
    """
    if "runs" in summary:
        cells = newest_cells(summary)
        # Without their run, the rows are labelled by arm alone (_label).
        ttft, decode = (
            [{k: v for k, v in r.items() if k != "run"} for r in cells[kind].values()]
            for kind in ("ttft", "decode")
        )
    else:
        ttft = [r for r in summary["ttft"] if r["ttft_s"] is not None]
        decode = [r for r in summary["decode"] if r["tok_s"] is not None]
    written = []
    if ttft:
        written.append(_panels(ttft, folder / "ttft.png", _ttft_panel))
    if decode:
        written.append(_panels(decode, folder / "decode.png", _decode_panel))
    return written


# --- the command ----------------------------------------------------------------------------------


def main(
    profile_name: str,
    out: Path,
    *,
    python: Path,
    vllm_command: Sequence[str] = (),
    arms: Sequence[str] = (),
    routers: Sequence[str] = (),
    experts: int | None = None,
    checkpoint_dir: Path | None = None,
    speculative: bool = True,
    plain: bool = True,
    concurrency: Sequence[int] = (),
    ttft: bool = True,
    decode: bool = True,
    online: bool = True,
    online_rates: Sequence[float] = (),
    pool_rows: int | None = None,
    dry_run: bool = False,
    deadline_s: float | None = None,
    argv: Sequence[str] = (),
) -> int:
    """``python -m harness replay e2e``: see the module docstring. ``concurrency``
    replaces the profile's decode concurrencies, ``ttft=False`` drops its TTFT runs,
    ``decode=False`` its decode runs, ``online_rates`` replaces its online request rates,
    ``online=False`` drops its online runs, and ``plain=False`` starts only the
    speculative-decoding servers, so that one profile's work can be split over several
    time-limited calls; ``pool_rows`` sizes every pool arm in rows per layer instead of
    the budget in GiB (to compare trees whose ``--moe-expert-pool-gb`` counts different
    things); ``deadline_s``, counted from now, makes the run skip what cannot finish in
    time (:meth:`Runner.fits`) instead of being cut."""
    started = time.monotonic()
    if deadline_s is not None and deadline_s <= 0:
        raise HarnessError(f"--deadline-s must be a positive number of seconds, not {deadline_s}")
    if not plain and not speculative:
        raise HarnessError("--spec-only and --no-spec leave no server to start; drop one")
    if not decode and concurrency:
        raise HarnessError("--concurrency sets the decode runs that --no-decode drops; drop one")
    if not online and online_rates:
        raise HarnessError("--online-rates sets the online runs that --no-online drops; drop one")
    if pool_rows is not None and pool_rows < 1:
        raise HarnessError(f"--pool-rows takes a positive number of rows, not {pool_rows}")
    if any(rate <= 0 for rate in online_rates):
        raise HarnessError(
            f"--online-rates takes request rates above 0 per second, not {list(online_rates)}"
        )
    if not decode and speculative:
        raise HarnessError(
            "--no-decode drops the plain servers' decode runs, but the ngram servers run "
            "nothing else (their decode at the profile's spec concurrencies); add --no-spec"
        )
    profiles = load_profiles()
    if profile_name not in profiles:
        raise HarnessError(f"unknown e2e profile {profile_name!r}; known: {', '.join(profiles)}")
    profile = profiles[profile_name]
    if not decode and not ttft and not (online and profile.measure.online_rates):
        raise HarnessError(
            "--no-decode and --no-ttft leave nothing to measure (and the profile's online "
            "runs are off or none); drop one"
        )
    if concurrency or online_rates or not ttft or not decode or not online:
        measure = dataclasses.replace(
            profile.measure,
            decode_concurrency=(tuple(concurrency) or profile.measure.decode_concurrency)
            if decode
            else (),
            ttft_input_lens=profile.measure.ttft_input_lens if ttft else (),
            online_rates=(tuple(online_rates) or profile.measure.online_rates) if online else (),
        )
        profile = dataclasses.replace(profile, measure=measure)
    if pool_rows is not None:
        sized = {
            name: dataclasses.replace(arm, rows=pool_rows) if arm.offload == "pool" else arm
            for name, arm in profile.arms.items()
        }
        profile = dataclasses.replace(profile, arms=sized)
    arms = list(arms) or list(profile.arms)
    routers = list(routers) or list(profile.routers)
    unknown = [a for a in arms if a not in profile.arms] + [
        r for r in routers if r not in checkpoint_routed.ROUTERS
    ]
    if unknown:
        raise HarnessError(
            f"profile {profile_name}: unknown {unknown}; arms: {', '.join(profile.arms)}; "
            f"routers: {', '.join(checkpoint_routed.ROUTERS)}"
        )
    spec = profile.checkpoint_spec(experts)
    ckpt = checkpoint_dir or out / "checkpoint"
    models = {router: str(ckpt / router) for router in routers}
    vllm = list(vllm_command) or [str(python.parent / "vllm")]
    env = {"VLLM_LOG_STATS_INTERVAL": str(profile.measure.stats_interval_s)}
    runner = Runner(
        profile, out, vllm, models, spec, arms, routers, speculative, plain,
        env=env, dry_run=dry_run,
        deadline=None if dry_run else run_deadline(started, deadline_s, os.environ),
    )  # fmt: skip
    gib = checkpoint_routed.expert_bytes(spec) / 2**30
    if dry_run:
        print(f"# {profile.description}")
        print(
            f"# experts {gib:.2f} GiB; budget {profile.budget:.0%} = {profile.budget * gib:.2f} GiB"
        )
        for name in arms:
            facts = offload_options(profile.arms[name], spec, profile.budget)
            facts.pop("fields")
            print(f"# {name}: {json.dumps(facts)}")
        print(f"# every server: {shlex.join(f'{k}={v}' for k, v in env.items())}")
        print(f"# python -m harness checkpoint {ckpt} --preset {profile.preset}"
              f" --routers {','.join(routers)}")  # fmt: skip
        runner.run()
        return 0
    checkpoint_routed.write(ckpt, spec, routers, echo=progress)
    runner.nvml = replay.load_nvml()
    runner.provenance = replay.server_provenance(python, argv)
    try:
        runner.run()
    finally:  # a run stopped by a time limit (SIGINT) still leaves its summary
        _write_run_summary(out)
    return 0


def fits(deadline: float | None, now: float, what: str, need_s: float) -> bool:
    """Whether ``what``, which takes at least ``need_s`` seconds from ``now``, ends before
    ``deadline`` (None: no limit); when it cannot, says so in the log."""
    if deadline is None:
        return True
    left = deadline - now
    if need_s <= left:
        return True
    progress(
        f"{what}: skipped, it needs at least {need_s:.0f} s and {max(left, 0):.0f} s are "
        "left before the run's deadline"
    )
    return False


def run_deadline(
    started: float, deadline_s: float | None, environ: Mapping[str, str]
) -> float | None:
    """The ``time.monotonic()`` value a run started at ``started`` must end by:
    ``deadline_s`` after it, or earlier where ``device_run.py`` interrupts this process
    sooner (:data:`TIME_LEFT_ENV`, less :data:`WIND_DOWN_S`); None for neither."""
    limits = [] if deadline_s is None else [started + deadline_s]
    given = environ.get(TIME_LEFT_ENV)
    if given:
        try:
            left = float(given)
        except ValueError as exc:
            raise HarnessError(f"{TIME_LEFT_ENV}={given!r} is not a number of seconds") from exc
        limits.append(started + left - WIND_DOWN_S)
        if limits[-1] == min(limits):
            progress(
                f"device_run.py interrupts this run in {left:.0f} s: it plans to end "
                f"{WIND_DOWN_S:.0f} s before that"
            )
    return min(limits, default=None)


def _write_run_summary(out: Path) -> None:
    """``summary.json`` and the plots of one run folder."""
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        for png in plot(summary, out):
            print(png)
    except ImportError:
        progress("no matplotlib here: summary.json is written, plots are not")
    print(out / "summary.json")
