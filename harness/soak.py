"""Stage 7c: a soak and robustness replay of a served expert pool.

``python -m harness replay soak --profile glm-shape-h200`` asks what a maintainer
asks before a server with the pool runs for days: does it stay correct, flat in
memory and quiet in its log under a churn of short requests, answer bad requests
with a 4xx, stop cleanly on SIGTERM with requests in flight, and refuse a bad pool
configuration before it loads any weights? A profile
(``harness/data/soak_profiles.toml``) names an e2e profile (:mod:`harness.e2e`:
checkpoint shape, arms, server options) and says how hard and how long to push
each arm's server. Per arm (``pool`` and ``resident`` by default):

1. **Start-up**: ``vllm serve`` with the arm's flags (:func:`harness.e2e.server_options`);
   the seconds to ``/health`` and the attention backend its log names.
2. **Greedy prompts**: a few fixed token-id prompts (``/v1/completions`` with
   ``prompt`` a list of ids), temperature 0, one at a time, before the churn (the
   warm-up) and after it; the summary compares each arm's texts after the churn with
   those of the arm that keeps every expert on the GPU (offload ``none``).
3. **Churn**: client threads (the standard library's ``http.client``) send requests
   for a stated time; prompt lengths and ``max_tokens`` are drawn from stated ranges
   by a seeded RNG (token ids from the checkpoint's vocabulary), some are streamed
   (SSE) and some of those are dropped after a random number of tokens (the client
   closes the connection). Each request records its status, whether it streamed
   and was dropped, and for streamed ones the TTFT and the gaps between chunks.
4. **Checkpoints** after a stated share of the churn and at its end: GPU memory
   used (NVML), the server's process group's host RSS and locked/pinned bytes
   (``VmRSS``, ``VmLck``, ``VmPin`` of ``/proc/PID/status``, the engine core
   included: :func:`tree_memory`) and the pool's ``/metrics`` counters
   (``vllm:moe_expert_pool_*``, the route-error gauge included).
5. **Bad requests** (:data:`BAD_REQUESTS`), each expected to answer 4xx with a
   message; the status and the body's first 200 characters are recorded, and
   ``/health`` must answer 200 afterwards.
6. **SIGTERM with requests in flight**: a few streaming requests, then SIGTERM to
   the server's process group only (SIGKILL only after the profile's
   ``sigterm_timeout_s``); the seconds until every process is gone, and whether
   NVML's GPU memory used returns to its level before the start. The last
   locked/pinned reading before the signal is kept (pinned memory goes with the
   process).
7. **The server log**: tracebacks and ``ERROR`` lines per phase (:data:`LOG_ERRORS`).

**Start-up faults** (``--faults``, a separate run): the server is started with a bad
pool configuration (:data:`FAULTS`) and the record says whether it failed, how
long it took, whether it failed before weight loading (the log has no
:data:`WEIGHTS_LOADED` line), and its message, against what the tree says it
should do. The host-RAM check of the pool (``check_host_memory``) reads vLLM's
``get_available_memory()``, which honours a cgroup's memory limit: that fault's
server runs in a memory cgroup of its own (:func:`memory_cgroup`, joined through
:data:`CGROUP_WRAPPER`), and where none can be made the record says why.

**Goal checks** (:func:`arm_checks`, :func:`fault_check`) are computed from the
result files, so that ``--summarize DIR`` recomputes them: each is ``pass``,
``fail`` or ``not measured``, with its numbers. ``summary.json`` and
``summary.md`` fold a folder. Each arm and fault is one JSON
(:func:`harness.results.write`), rewritten after every phase, so that a run cut by
its time limit keeps what it measured; an arm or fault whose complete result exists
is not run again (a later call with the same ``--out`` goes on where one stopped).
With a deadline (:func:`harness.e2e.run_deadline`) an arm starts only when its
start, its churn and what follows fit, and the churn is cut to the time left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import itertools
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import threading
import time
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from harness import checkpoint, checkpoint_routed, e2e, replay, results
from harness.project import HarnessError, progress
from harness.replay import host_used_bytes

PROFILES = Path(__file__).resolve().parent / "data" / "soak_profiles.toml"
COMPLETIONS = "/v1/completions"
#: What the summary keeps of a response body.
BODY_CHARS = 200
#: A server log line that says weights were loaded: a fault logged after one failed late.
WEIGHTS_LOADED = re.compile(r"Loading weights took|Model loading took")
#: Server-side errors in a log: Python tracebacks and vLLM's ERROR / CRITICAL lines.
LOG_ERRORS = {
    "tracebacks": re.compile(r"^.*Traceback \(most recent call last\)", re.M),
    "error_lines": re.compile(r"^.*\b(?:ERROR|CRITICAL)\b.*$", re.M),
}
#: Seconds an arm keeps, after its churn, for the greedy prompts and the bad requests
#: (the shutdown's own bound, ``sigterm_timeout_s + release_wait_s``, is added).
AFTER_CHURN_S = 30.0
#: A check's outcome.
PASS, FAIL, NOT_MEASURED = "pass", "fail", "not measured"


# --- profiles -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Greedy:
    """The fixed greedy prompts."""

    prompts: int = 4
    prompt_len: int = 32
    max_tokens: int = 32
    seed: int = 1


@dataclasses.dataclass(frozen=True)
class Churn:
    """The churn: ``clients`` threads for ``duration_s``."""

    clients: int = 16
    duration_s: float = 150.0
    prompt_len: tuple[int, int] = (16, 512)
    max_tokens: tuple[int, int] = (1, 32)
    temperature: float = 1.0
    stream_fraction: float = 0.5
    drop_fraction: float = 0.2  # of the streamed requests
    first_checkpoint: float = 0.2  # share of the churn after which the first checkpoint is taken
    request_timeout_s: float = 120.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """SIGTERM with ``in_flight`` streaming requests of ``max_tokens``."""

    in_flight: int = 4
    max_tokens: int = 512
    sigterm_timeout_s: float = 45.0  # then SIGKILL
    release_wait_s: float = 10.0  # how long NVML may take to show the memory released


@dataclasses.dataclass(frozen=True)
class Goals:
    """The thresholds the checks hold an arm to (a profile's ``goals`` table)."""

    min_requests: int = 500
    flat_within: float = 0.01
    exit_within_s: float = 30.0
    gpu_released_within_mib: float = 1024.0
    # Host memory in use (system-wide) after the exit, against before the start: pinned
    # pages the server held and did not give back stay in use.
    host_released_within_mib: float = 2048.0


@dataclasses.dataclass(frozen=True)
class Profile:
    """A soak profile: an e2e profile's servers, and how each is pushed and checked."""

    name: str
    description: str
    e2e: e2e.Profile
    router: str
    arms: tuple[str, ...]
    bad_requests: tuple[str, ...]
    faults: tuple[str, ...]
    greedy: Greedy
    churn: Churn
    shutdown: Shutdown
    goals: Goals
    # What a deadline assumes a failing fault start takes.
    fault_floor_s: float = 30.0

    @property
    def max_model_len(self) -> int:
        given = self.e2e.server.get("max_model_len")
        return int(given) if given else self.e2e.checkpoint_spec().max_position_embeddings


_T = TypeVar("_T")
#: The tables of a profile and the dataclass each becomes.
_TABLES: dict[str, type[Any]] = {
    "greedy": Greedy, "churn": Churn, "shutdown": Shutdown, "goals": Goals,
}  # fmt: skip
PROFILE_KEYS = frozenset(
    {"description", "e2e_profile", "router", "arms", "bad_requests", "faults", "fault_floor_s"}
    | set(_TABLES)
)


def _table(cls: type[_T], body: Mapping[str, Any], where: str) -> _T:
    """``cls`` from a TOML table; lists become tuples, unknown keys are errors."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(body) - known)
    if unknown:
        raise HarnessError(f"{where}: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in body.items()})


def load_profiles(path: Path = PROFILES) -> dict[str, Profile]:
    """Every soak profile in ``path``, checked against its e2e profile."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HarnessError(f"cannot read {path}: {exc}") from exc
    others = e2e.load_profiles()
    profiles = {}
    for name, body in data.items():
        where = f"{path}: profile {name}"
        if not isinstance(body, dict):
            raise HarnessError(f"{path}: {name} = {body!r} is not a profile table")
        unknown = sorted(set(body) - PROFILE_KEYS)
        if unknown:
            raise HarnessError(f"{where}: unknown keys {unknown}; known: {sorted(PROFILE_KEYS)}")
        base = others.get(body.get("e2e_profile", ""))
        if base is None:
            raise HarnessError(f"{where}: e2e_profile must be one of {sorted(others)}")
        tables = {k: _table(cls, body.get(k, {}), f"{where}.{k}") for k, cls in _TABLES.items()}
        try:
            profile = Profile(
                name=name,
                description=body.get("description", ""),
                e2e=base,
                router=body.get("router", base.routers[0]),
                arms=tuple(body.get("arms", ("pool", "resident"))),
                bad_requests=tuple(body.get("bad_requests", BAD_REQUESTS)),
                faults=tuple(body.get("faults", FAULTS)),
                fault_floor_s=float(body.get("fault_floor_s", 30)),
                **tables,
            )
        except (TypeError, ValueError) as exc:
            raise HarnessError(f"{where}: {exc}") from exc
        _check(profile, where)
        profiles[name] = profile
    return profiles


def _check(profile: Profile, where: str) -> None:
    problems = [f"arm {a!r} is not in e2e profile {profile.e2e.name}"
                for a in profile.arms if a not in profile.e2e.arms]  # fmt: skip
    problems += [f"unknown bad request {b!r}" for b in profile.bad_requests
                 if b not in BAD_REQUESTS]  # fmt: skip
    problems += [f"unknown fault {f!r}" for f in profile.faults if f not in FAULTS]
    if profile.router not in checkpoint_routed.ROUTERS:
        problems.append(f"router must be one of {checkpoint_routed.ROUTERS}")
    churn = profile.churn
    for key in ("prompt_len", "max_tokens"):
        low, high = getattr(churn, key)
        if not 1 <= low <= high:
            problems.append(f"churn.{key} must be [low, high] with 1 <= low <= high")
    for key in ("stream_fraction", "drop_fraction", "first_checkpoint"):
        if not 0 <= getattr(churn, key) <= 1:
            problems.append(f"churn.{key} must be in [0, 1]")
    if problems:
        raise HarnessError(f"{where}: " + "; ".join(problems))


# --- requests -------------------------------------------------------------------------------------


def completion_body(
    model: str, prompt: Sequence[int], max_tokens: int, temperature: float, stream: bool
) -> bytes:
    """A ``/v1/completions`` request of token ids; ``ignore_eos``, so that it runs its length."""
    return json.dumps({
        "model": model, "prompt": list(prompt), "max_tokens": max_tokens,
        "temperature": temperature, "stream": stream, "ignore_eos": True,
    }).encode()  # fmt: skip


def post(
    port: int,
    body: bytes,
    timeout_s: float,
    *,
    stream: bool = False,
    drop_after: int | None = None,
    first_chunk: threading.Event | None = None,
) -> dict[str, Any]:
    """One ``POST /v1/completions``; what the server or the connection does is recorded,
    never raised.

    ``status`` is 0 where no response came. A streamed 200 reads Server-Sent Events
    until ``data: [DONE]``; each chunk's arrival is stamped (TTFT, gaps between chunks),
    and after ``drop_after`` chunks the client closes the connection (``dropped``). A
    stream that ends without ``[DONE]``, or a chunk with an ``error``, is an ``error``.
    """
    started = time.perf_counter()
    out: dict[str, Any] = {"status": 0, "stream": stream, "dropped": False, "error": None}
    stamps: list[float] = []
    text: list[str] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", COMPLETIONS, body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        out["status"] = reply.status
        if not stream or reply.status != 200:
            raw = reply.read().decode(errors="replace")
            if reply.status != 200:
                out["body"] = raw[:BODY_CHARS]
            else:
                answer = json.loads(raw)
                text = [c.get("text", "") for c in answer.get("choices", [])]
                out["tokens"] = (answer.get("usage") or {}).get("completion_tokens")
        else:
            done = False
            for line in reply:
                if not line.startswith(b"data:"):
                    continue
                payload = line.removeprefix(b"data:").strip()
                if payload == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    out["error"] = f"error in the stream: {str(chunk['error'])[:BODY_CHARS]}"
                    break
                stamps.append(time.perf_counter())
                if first_chunk is not None:
                    first_chunk.set()
                text += [c.get("text", "") for c in chunk.get("choices", [])]
                if drop_after is not None and len(stamps) >= drop_after:
                    out["dropped"] = True
                    break
            if not done and not out["dropped"] and out["error"] is None:
                out["error"] = "the stream ended without [DONE]"
            out["tokens"] = len(stamps)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:BODY_CHARS]
    finally:
        conn.close()
    out["latency_ms"] = round(1000 * (time.perf_counter() - started), 1)
    if stamps:
        out["ttft_ms"] = round(1000 * (stamps[0] - started), 1)
        out["gaps_ms"] = [round(1000 * (b - a), 1) for a, b in itertools.pairwise(stamps)]
    out["text"] = "".join(text)
    return out


@dataclasses.dataclass(frozen=True)
class BadRequest:
    """A request the server must refuse with a 4xx and a message."""

    what: str
    body: Callable[[str, int, int], bytes]  # (model, vocabulary size, max model length)


def _json(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


BAD_REQUESTS: dict[str, BadRequest] = {
    "token-past-vocab": BadRequest(
        "a prompt token id past the vocabulary",
        lambda model, vocab, ctx: _json(model=model, prompt=[1, vocab + 1000], max_tokens=4),
    ),
    "max-tokens-past-context": BadRequest(
        "max_tokens past the context length",
        lambda model, vocab, ctx: _json(model=model, prompt=[1, 2, 3], max_tokens=ctx + 1),
    ),
    "malformed-json": BadRequest(
        "a body that is not JSON",
        lambda model, vocab, ctx: b'{"model": "' + model.encode() + b'", "prompt": [1, 2',
    ),
    "empty-prompt": BadRequest(
        "an empty token-id prompt",
        lambda model, vocab, ctx: _json(model=model, prompt=[], max_tokens=4),
    ),
    "unknown-model": BadRequest(
        "a model name the server does not serve",
        lambda model, vocab, ctx: _json(model="no-such-model", prompt=[1, 2], max_tokens=4),
    ),
    "oversized-n": BadRequest(
        "n past VLLM_MAX_N_SEQUENCES (16384)",
        lambda model, vocab, ctx: _json(
            model=model, prompt=[1, 2], max_tokens=4, n=100_000, temperature=1.0
        ),
    ),
    "oversized-logprobs": BadRequest(
        "logprobs past --max-logprobs (20 by default)",
        lambda model, vocab, ctx: _json(model=model, prompt=[1, 2], max_tokens=4, logprobs=10_000),
    ),
}


def error_message(body: str) -> str:
    """The message of an error body: vLLM's ``error.message`` (or ``message``, FastAPI's
    ``detail``), else the body itself."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()
    if isinstance(data, dict):
        inner = data.get("error")
        found = inner.get("message") if isinstance(inner, dict) else inner
        found = found or data.get("message") or data.get("detail")
        return str(found or "").strip()
    return body.strip()


# --- memory ---------------------------------------------------------------------------------------

#: ``/proc/PID/status`` fields of :func:`tree_memory`, in kB there.
STATUS_FIELDS = {"VmRSS": "rss_bytes", "VmLck": "locked_bytes", "VmPin": "pinned_bytes"}


def process_memory(pid: int, proc: Path = Path("/proc")) -> dict[str, Any] | None:
    """Name, RSS, locked and pinned bytes of one process; None when it is gone."""
    try:
        lines = (proc / str(pid) / "status").read_text().splitlines()
    except OSError:
        return None
    out: dict[str, Any] = {"pid": pid, **dict.fromkeys(STATUS_FIELDS.values(), 0)}
    for line in lines:
        key, _, value = line.partition(":")
        if key == "Name":
            out["name"] = value.strip()
        elif key in STATUS_FIELDS:
            out[STATUS_FIELDS[key]] = int(value.split()[0]) * 1024
    return out


def tree_memory(pgid: int) -> dict[str, Any]:
    """RSS, locked (``VmLck``) and pinned (``VmPin``) bytes of every live process of the
    server's process group (the API server, its engine core and workers), and their sums."""
    members = [m for pid in replay.group_members(pgid) if (m := process_memory(pid))]
    return {
        "processes": members,
        **{key: sum(m[key] for m in members) for key in STATUS_FIELDS.values()},
    }


def gpu_memory(nvml: Any | None) -> dict[str, float] | None:
    """MiB of memory used per GPU (NVML), or None without NVML."""
    if nvml is None:
        return None
    return {str(r["gpu"]): r["mem_used_mib"] for r in replay.NvmlSampler(nvml).sample()}


# --- faults ---------------------------------------------------------------------------------------

FAILS = "fails before weight loading"
STARTS = "starts (documented)"


@dataclasses.dataclass(frozen=True)
class Fault:
    """A bad pool configuration and what the patched tree does with it."""

    what: str
    expect: str  # FAILS or STARTS
    source: str  # where the tree decides it
    flags: Callable[[checkpoint.Spec], tuple[str, ...]]
    message: Callable[[checkpoint.Spec], str]  # a regex the log must match
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # "": the profile's checkpoint; else a key of FAULT_MODELS, a small model the run
    # writes itself, whose spec the flags and the message are made from
    model: str = ""
    # The bytes of a memory cgroup (cgroup v2 memory.max) the server runs in, as in a
    # container with that memory limit; None: no cgroup
    cgroup_memory: Callable[[checkpoint.Spec], int] | None = None


#: The small models of the faults that need a model the pool must not take.
FAULT_MODELS = {
    "dense": checkpoint.Spec(dense=True),
    "bf16-moe": checkpoint.Spec(weights="bf16"),
}


def _rows(n: int) -> tuple[str, ...]:
    return ("--moe-expert-pool-rows", str(n))


def _gib_above(spec: checkpoint.Spec) -> int:
    return math.ceil(checkpoint_routed.expert_bytes(spec) / 2**30) + 1


FAULTS: dict[str, Fault] = {
    "rows-below-top-k": Fault(
        "--moe-expert-pool-rows top_k - 1",
        FAILS,
        "expert_pool/install.py: layer_pool_decision, as each MoE layer is built",
        lambda s: _rows(s.top_k - 1),
        lambda s: rf"needs at least top_k={s.top_k} rows per layer",
    ),
    "rows-above-experts": Fault(
        "--moe-expert-pool-rows experts + 1",
        STARTS,
        "expert_pool/install.py: install_expert_pool keeps min(N, experts - 1) rows per "
        "layer, as the flag's help (--help=OffloadConfig) says",
        lambda s: _rows(s.experts + 1),
        lambda s: rf"Expert pool: \d+ layers x {s.experts} experts, {s.experts - 1} rows per layer",
    ),
    "gb-above-experts": Fault(
        "--moe-expert-pool-gb above the bytes of every expert",
        STARTS,
        "expert_pool/install.py: _slots_for_budget keeps min(fit, experts - 1) rows per layer",
        lambda s: ("--moe-expert-pool-gb", str(_gib_above(s))),
        lambda s: rf"--moe-expert-pool-gb={_gib_above(s)}: {s.experts - 1} rows per layer",
    ),
    "rows-and-gb": Fault(
        "--moe-expert-pool-rows and --moe-expert-pool-gb together",
        FAILS,
        "config/offload.py: OffloadConfig.validate_offload_config, as the config is validated",
        lambda s: (*_rows(s.top_k), "--moe-expert-pool-gb", "10"),
        lambda s: r"moe_expert_pool_rows and moe_expert_pool_gb are mutually exclusive",
    ),
    "dense-model": Fault(
        "--moe-expert-pool-rows on a dense model (a small NVFP4 Qwen3 without experts)",
        FAILS,
        "config/offload.py: OffloadConfig.verify_moe_expert_pool, as the config is validated",
        lambda s: _rows(s.top_k),
        lambda s: r"is not a mixture-of-experts model",
        model="dense",
    ),
    "non-nvfp4-moe": Fault(
        "--moe-expert-pool-rows on a bf16 MoE model (no quantization)",
        FAILS,
        "config/offload.py: OffloadConfig.verify_moe_expert_pool, as the config is validated",
        lambda s: _rows(s.top_k),
        lambda s: r"is not quantized, and the expert pool holds NVFP4 experts",
        model="bf16-moe",
    ),
    "pin-memory-disabled": Fault(
        "the pool with VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1",
        FAILS,
        "expert_pool/install.py: check_host_memory, before a layer's experts are pinned",
        lambda s: _rows(s.top_k),
        lambda s: r"VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1 disables pinning",
        env={"VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY": "1"},
    ),
    "host-ram-below-pool": Fault(
        "a container memory limit (cgroup v2 memory.max) of half the bytes the pool pins",
        FAILS,
        "expert_pool/install.py: check_host_memory (vLLM's get_available_memory, which "
        "honours the cgroup's limit), before a layer's experts are pinned",
        lambda s: _rows(s.top_k),
        lambda s: r"of pinned host memory .* GiB of host memory are available",
        cgroup_memory=lambda s: checkpoint_routed.expert_bytes(s) // 2,
    ),
}

#: Where a fault's memory cgroup is made (the cgroup v2 hierarchy of the host).
CGROUP_ROOT = Path("/sys/fs/cgroup")

#: ``sh -c CGROUP_WRAPPER sh FOLDER ARGV...`` runs ARGV in the cgroup FOLDER, in a mount
#: namespace whose /sys/fs/cgroup is that cgroup's folder (bind-mounted): what a container
#: sees of its own, where vLLM reads its memory limit (/sys/fs/cgroup/memory.max). A fresh
#: cgroup2 mount there is refused where the host's hierarchy is already mounted (EBUSY on
#: the H200 host), a bind mount is not.
CGROUP_WRAPPER = (
    'echo $$ > "$1/cgroup.procs" && exec unshare --mount sh -c '
    '\'mount --bind "$1" /sys/fs/cgroup && shift && exec "$@"\' sh "$@"'
)


def cgroup_folder(name: str, root: Path = CGROUP_ROOT) -> Path:
    """The child cgroup the server of fault ``name`` runs in."""
    return root / f"harness-soak-{name}"


def memory_cgroup(name: str, limit: int, root: Path = CGROUP_ROOT) -> Path:
    """Make (or reuse) :func:`cgroup_folder` with ``memory.max`` = ``limit`` bytes;
    :class:`HarnessError` says why it cannot be made on this host."""
    controllers = root / "cgroup.subtree_control"
    try:
        enabled = controllers.read_text().split()
    except OSError as exc:
        raise HarnessError(f"no cgroup v2 hierarchy at {root} ({exc})") from exc
    if "memory" not in enabled:
        raise HarnessError(f"the memory controller is not enabled in {controllers}")
    if shutil.which("unshare") is None:
        raise HarnessError("no unshare command (util-linux) to give the server its own view")
    folder = cgroup_folder(name, root)
    try:
        folder.mkdir(exist_ok=True)
        (folder / "memory.max").write_text(f"{limit}\n")
    except OSError as exc:
        raise HarnessError(f"cannot make the memory cgroup {folder}: {exc}") from exc
    return folder


# --- the runner -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Runner:
    """The arms or the faults of a profile; all effects go through ``vllm`` and ``results``."""

    profile: Profile
    out: Path
    vllm: Sequence[str]
    model: str  # the checkpoint folder of the profile's router
    spec: checkpoint.Spec
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    dry_run: bool = False
    nvml: Any | None = None
    provenance: Callable[[], dict[str, Any]] = dataclasses.field(
        default_factory=lambda: results.provenance
    )
    echo: Callable[[str], None] = print
    deadline: float | None = None  # a ``clock()`` value the run must end by; None: no limit
    clock: Callable[[], float] = time.monotonic
    startups: list[float] = dataclasses.field(default_factory=list)  # server starts, s
    health_poll_s: float = 1.0
    stop_timeout_s: float = e2e.STOP_TIMEOUT_S
    written: list[Path] = dataclasses.field(default_factory=list)
    make_cgroup: Callable[[str, int], Path] = memory_cgroup

    def run(self, arms: Sequence[str], faults: Sequence[str] = ()) -> list[Path]:
        """Each arm, then each fault; one whose complete result exists is skipped."""
        if self.dry_run:
            self._print_plan(arms, faults)
            return []
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self._record(f"plan-{stamp}", "soak-plan", {"arms": list(arms), "faults": list(faults)})
        for name in arms:
            if self._complete(f"soak-{name}"):
                progress(f"soak-{name}.json is complete in {self.out}; not run again")
            elif self._fits(f"arm {name}", self._startup_need() + self._arm_need()):
                self._arm(name)
        for name in faults:
            fault = FAULTS[name]
            need = self._startup_need() if fault.expect == STARTS else self.profile.fault_floor_s
            if self._complete(f"fault-{name}"):
                progress(f"fault-{name}.json is complete in {self.out}; not run again")
            elif self._fits(f"fault {name}", need):
                self._fault(name, fault)
        return self.written

    # -- helpers

    def _fits(self, what: str, need_s: float) -> bool:
        return e2e.fits(self.deadline, self.clock(), what, need_s)

    def _startup_need(self) -> float:
        """The fastest start of this run so far, or the e2e profile's floor before the first."""
        return min(self.startups, default=self.profile.e2e.startup_floor_s)

    def _arm_need(self) -> float:
        """What an arm needs after its start: the churn and what follows it."""
        return self.profile.churn.duration_s + self._after_churn_s()

    def _after_churn_s(self) -> float:
        down = self.profile.shutdown
        return AFTER_CHURN_S + down.sigterm_timeout_s + down.release_wait_s

    def _complete(self, name: str) -> bool:
        path = self.out / f"{name}.json"
        return path.exists() and bool(json.loads(path.read_text())["data"].get("complete"))

    def _options(self, arm: str) -> replay.ServerOptions:
        return e2e.server_options(self.profile.e2e, self.profile.e2e.arms[arm], self.spec, False)

    def _fault_spec(self, fault: Fault) -> checkpoint.Spec:
        return FAULT_MODELS[fault.model] if fault.model else self.spec

    def _fault_model(self, fault: Fault) -> str:
        """The checkpoint a fault's server loads: the profile's, or its small model,
        written under ``OUT/models`` (in seconds) unless a dry run."""
        if not fault.model:
            return self.model
        folder = self.out / "models" / fault.model
        if not self.dry_run:
            checkpoint.write(folder, FAULT_MODELS[fault.model])
        return str(folder)

    def _fault_options(self, fault: Fault) -> replay.ServerOptions:
        """The e2e profile's server with the fault's flags; a small model gets the flags
        alone (the profile's context length or MoE backend could be refused first)."""
        flags = fault.flags(self._fault_spec(fault))
        if fault.model:
            return replay.ServerOptions(model=fault.model, extra_args=flags)
        base = e2e.server_options(self.profile.e2e, e2e.Arm("fault", "none"), self.spec, False)
        return dataclasses.replace(base, extra_args=(*base.extra_args, *flags))

    def _server(
        self,
        tag: str,
        options: replay.ServerOptions,
        model: str,
        env: Mapping[str, str],
        cgroup: Path | None = None,
    ) -> replay.Server:
        """A server of ``options``; in the memory cgroup folder ``cgroup`` if given."""
        port = 8000 if self.dry_run else replay.free_port()
        argv = replay.serve_argv(self.vllm, options, model, port)
        if cgroup is not None:
            argv = ["sh", "-c", CGROUP_WRAPPER, "sh", str(cgroup), *argv]
        log = self.out / "logs" / f"{tag}.server.log"
        return replay.Server(argv, port, log, {**self.env, **env}, self.stop_timeout_s)

    def _record(
        self, name: str, kind: str, data: dict[str, Any], server_argv: Sequence[str] = ()
    ) -> None:
        prov = self.provenance()
        prov["server_argv"] = list(server_argv)
        prov["env"] = {**replay.server_env(os.environ), **self.env}
        record = {"profile": self.profile.name, "e2e_profile": self.profile.e2e.name,
                  "router": self.profile.router, "checkpoint": dataclasses.asdict(self.spec),
                  **data}  # fmt: skip
        path = results.write(self.out / f"{name}.json", kind, record, prov)
        if path not in self.written:
            self.written.append(path)
        progress(f"wrote {path}")

    # -- the plan of a dry run

    def _print_plan(self, arms: Sequence[str], faults: Sequence[str]) -> None:
        echo = self.echo
        for name in arms:
            echo(f"## arm {name}")
            echo(shlex.join(self._server(name, self._options(name), self.model, {}).argv))
        if arms:
            self._print_arm_plan()
        for name in faults:
            fault = FAULTS[name]
            echo(f"## fault {name}: {fault.what}; expected: {fault.expect}, the log matching "
                 f"/{fault.message(self._fault_spec(fault))}/ ({fault.source})")  # fmt: skip
            model = self._fault_model(fault)
            cgroup = None
            if fault.cgroup_memory is not None:
                cgroup = cgroup_folder(name)
                echo(f"# in the memory cgroup {cgroup}, memory.max = "
                     f"{fault.cgroup_memory(self._fault_spec(fault))} bytes")  # fmt: skip
            argv = self._server(name, self._fault_options(fault), model, {}, cgroup).argv
            echo(shlex.join([*(f"{k}={v}" for k, v in fault.env.items()), *argv]))

    def _print_arm_plan(self) -> None:
        """What every arm's server is sent, and how it is stopped."""
        p, echo = self.profile, self.echo
        churn, down, greedy = p.churn, p.shutdown, p.greedy
        echo(f"# greedy: {greedy.prompts} prompts of {greedy.prompt_len} token ids (seed "
             f"{greedy.seed}), max_tokens {greedy.max_tokens}, temperature 0, one at a time, "
             "before the churn (warm-up) and after it")  # fmt: skip
        first = churn.first_checkpoint * churn.duration_s
        echo(f"# churn: {churn.clients} clients for {churn.duration_s:.0f} s, prompts of "
             f"{churn.prompt_len[0]}-{churn.prompt_len[1]} token ids of {self.spec.vocab_size}, "
             f"max_tokens {churn.max_tokens[0]}-{churn.max_tokens[1]}, temperature "
             f"{churn.temperature:g}, {churn.stream_fraction:.0%} streamed and "
             f"{churn.drop_fraction:.0%} of those dropped after a random number of tokens, "
             f"seed {churn.seed}; checkpoints at {first:.0f} s and at the end")  # fmt: skip
        echo("# bad requests, each expected to answer 4xx with a message:")
        for name in p.bad_requests:
            bad = BAD_REQUESTS[name]
            body = bad.body(self.model, self.spec.vocab_size, p.max_model_len)
            echo(f"#   {name} ({bad.what}): {body.decode()[:BODY_CHARS]}")
        echo(f"# shutdown: {down.in_flight} streaming requests of {down.max_tokens} tokens in "
             f"flight, SIGTERM to the process group, exit expected within "
             f"{p.goals.exit_within_s:.0f} s (SIGKILL after {down.sigterm_timeout_s:.0f} s), "
             f"GPU memory back within {p.goals.gpu_released_within_mib:.0f} MiB of its level "
             "before the start")  # fmt: skip

    # -- one arm

    def _arm(self, name: str) -> None:
        p = self.profile
        arm = p.e2e.arms[name]
        server = self._server(name, self._options(name), self.model, {})
        budget = e2e.offload_options(arm, self.spec, p.e2e.budget)
        budget.pop("fields")
        data: dict[str, Any] = {
            "arm": name, "offload": arm.offload, "complete": False,
            "goals": dataclasses.asdict(p.goals),
            "budget": {"fraction": p.e2e.budget, **budget},
            "plan": {"greedy": dataclasses.asdict(p.greedy), "churn": dataclasses.asdict(p.churn),
                     "shutdown": dataclasses.asdict(p.shutdown),
                     "bad_requests": list(p.bad_requests)},
        }  # fmt: skip

        def save() -> None:
            self._record(f"soak-{name}", "soak-arm", data, server.argv)

        marks: dict[str, int] = {}

        def mark(phase: str) -> None:
            marks[phase] = server.log.stat().st_size if server.log.exists() else 0

        data["gpu_mib_before_start"] = gpu_memory(self.nvml)
        data["host_used_before_start"] = host_used_bytes()
        started = self.clock()
        try:
            with server:
                state = server.wait_healthy(p.e2e.startup_timeout_s, self.health_poll_s)
                data["startup_s"] = round(self.clock() - started, 1)
                mark("startup")
                text = server.log.read_text(errors="replace") if server.log.exists() else ""
                data.update(state=state, facts=e2e.server_facts(text),
                            attention_backend=e2e.attention_backend(text))  # fmt: skip
                if state != "ok":
                    outcome, message = replay.classify_failure(text)
                    data.update(failure=outcome, exception=message, log_tail=server.log_tail(60))
                    data["complete"] = True
                    progress(f"{name}: server did not start ({state}); next arm")
                    return
                self.startups.append(data["startup_s"])
                assert server.proc is not None
                pgid = server.proc.pid
                data["greedy_before"] = self._greedy(server.port)
                save()
                churn_s = p.churn.duration_s
                if self.deadline is not None:
                    churn_s = min(churn_s, self.deadline - self.clock() - self._after_churn_s())
                data["churn_s"] = round(max(churn_s, 0.0), 1)
                if churn_s < p.churn.duration_s:
                    progress(f"{name}: the churn is cut to {churn_s:.0f} s by the deadline")
                progress(f"{name}: {p.churn.clients} clients for {data['churn_s']:.0f} s")
                requests, checkpoints = run_churn(
                    server.port, self.model, p.churn, self.spec.vocab_size, max(churn_s, 0.0),
                    lambda: self._checkpoint(server.url, pgid),
                )  # fmt: skip
                data.update(requests=requests, checkpoints=checkpoints)
                progress(f"{name}: {len(requests)} requests; greedy prompts, bad requests, SIGTERM")
                data["greedy_after"] = self._greedy(server.port)
                mark("serving")
                save()
                data["bad_requests"] = self._bad_requests(server.port)
                data["health_after_bad_requests"] = replay.http_get(server.url + "/health")[0]
                mark("bad_requests")
                save()
                data["shutdown"] = self._sigterm(server, pgid, data["gpu_mib_before_start"])
            mark("shutdown")
            data["complete"] = True
        finally:
            if marks:
                data["log_errors"] = log_errors(server.log, marks)
            data["server_log"] = str(server.log)
            save()

    def _checkpoint(self, url: str, pgid: int) -> dict[str, Any]:
        return {
            "gpu_mib": gpu_memory(self.nvml),
            "host": tree_memory(pgid),
            "host_used_bytes": host_used_bytes(),
            "pool_metrics": replay.scrape_metrics(url, e2e.POOL_METRICS),
        }

    def _greedy(self, port: int) -> list[dict[str, Any]]:
        g = self.profile.greedy
        rng = random.Random(g.seed)
        out = []
        for _ in range(g.prompts):
            prompt = [rng.randrange(self.spec.vocab_size) for _ in range(g.prompt_len)]
            body = completion_body(self.model, prompt, g.max_tokens, 0.0, False)
            reply = post(port, body, self.profile.churn.request_timeout_s)
            out.append({k: reply.get(k) for k in ("status", "text", "error", "latency_ms")})
        return out

    def _bad_requests(self, port: int) -> list[dict[str, Any]]:
        out = []
        for name in self.profile.bad_requests:
            bad = BAD_REQUESTS[name]
            body = bad.body(self.model, self.spec.vocab_size, self.profile.max_model_len)
            reply = post(port, body, self.profile.churn.request_timeout_s)
            out.append({
                "kind": name, "what": bad.what, "status": reply["status"],
                "body": reply.get("body", ""), "error": reply["error"],
            })  # fmt: skip
        return out

    def _sigterm(
        self, server: replay.Server, pgid: int, before: Mapping[str, float] | None
    ) -> dict[str, Any]:
        """SIGTERM to the group with streaming requests in flight; SIGKILL only after
        ``sigterm_timeout_s`` (``Server.stop``)."""
        down, goals = self.profile.shutdown, self.profile.goals
        rng = random.Random(self.profile.churn.seed)
        replies: list[dict[str, Any]] = []
        firsts = [threading.Event() for _ in range(down.in_flight)]

        def send(first: threading.Event, prompt: list[int]) -> None:
            body = completion_body(self.model, prompt, down.max_tokens, 1.0, True)
            replies.append(post(server.port, body, down.sigterm_timeout_s, stream=True,
                                first_chunk=first))  # fmt: skip

        threads = [
            threading.Thread(
                target=send, args=(e, [rng.randrange(self.spec.vocab_size) for _ in range(32)]),
                daemon=True,
            )
            for e in firsts
        ]  # fmt: skip
        for thread in threads:
            thread.start()
        until = time.monotonic() + 30
        streaming = sum(e.wait(timeout=max(0.0, until - time.monotonic())) for e in firsts)
        last = tree_memory(pgid)
        assert server.proc is not None
        alive = server.proc.poll() is None
        sent = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        leader_s = group_s = None
        while time.monotonic() - sent < down.sigterm_timeout_s:
            if leader_s is None and server.proc.poll() is not None:
                leader_s = time.monotonic() - sent
            if not replay.group_members(pgid):
                group_s = time.monotonic() - sent
                break
            time.sleep(0.05)
        escalated = group_s is None
        if escalated:
            server.stop()  # SIGTERM again, then SIGKILL
        for thread in threads:
            thread.join(timeout=10)
        after = gpu_memory(self.nvml)
        waited = time.monotonic()
        tolerance = goals.gpu_released_within_mib
        while before is not None and after is not None and not _released(before, after, tolerance):
            if time.monotonic() - waited > down.release_wait_s:
                break
            time.sleep(0.5)
            after = gpu_memory(self.nvml)
        return {
            "in_flight": down.in_flight,
            "streaming_at_signal": streaming,
            "alive_at_signal": alive,
            "last_before_signal": {k: last[k] for k in STATUS_FIELDS.values()},
            "leader_exit_s": None if leader_s is None else round(leader_s, 2),
            "exit_s": None if group_s is None else round(group_s, 2),
            "escalated_to_sigkill": escalated,
            "returncode": server.proc.poll(),
            "gpu_mib_after_exit": after,
            "host_used_after_exit": host_used_bytes(),
            "replies": [{k: r.get(k) for k in ("status", "tokens", "error")} for r in replies],
        }

    # -- faults

    def _fault_record(self, name: str, fault: Fault) -> dict[str, Any]:
        spec = self._fault_spec(fault)
        return {
            "fault": name, "what": fault.what, "source": fault.source, "complete": True,
            "expected": {"outcome": fault.expect, "message": fault.message(spec)},
            "env": dict(fault.env),
            "model": dataclasses.asdict(spec) if fault.model else None,
            "cgroup_memory_max": fault.cgroup_memory(spec) if fault.cgroup_memory else None,
        }  # fmt: skip

    def _fault(self, name: str, fault: Fault) -> None:
        model = self._fault_model(fault)
        cgroup = None
        if fault.cgroup_memory is not None:
            try:
                cgroup = self.make_cgroup(name, fault.cgroup_memory(self._fault_spec(fault)))
            except HarnessError as exc:
                data = self._fault_record(name, fault)
                data["observed"] = {"outcome": "not run", "reason": f"on this host: {exc}"}
                self._record(f"fault-{name}", "soak-fault", data)
                return
        server = self._server(f"fault-{name}", self._fault_options(fault), model, fault.env, cgroup)
        started = self.clock()
        with server:
            state = server.wait_healthy(self.profile.e2e.startup_timeout_s, self.health_poll_s)
            seconds = round(self.clock() - started, 1)
        if cgroup is not None:
            with contextlib.suppress(OSError):  # a process left in it keeps it
                cgroup.rmdir()
        text = server.log.read_text(errors="replace") if server.log.exists() else ""
        if state == "ok":
            self.startups.append(seconds)
        pattern = re.compile(fault.message(self._fault_spec(fault)))
        line = next((ln.strip() for ln in text.splitlines() if pattern.search(ln)), "")
        data = self._fault_record(name, fault)
        data["observed"] = {
            "outcome": {"ok": "starts", "exited": "fails", "timeout": "timeout"}[state],
            "seconds": seconds,
            "weights_loaded": bool(WEIGHTS_LOADED.search(text)),
            "message_matches": bool(line),
            "message": line[:500] or replay.classify_failure(text)[1][:500],
            "returncode": server.returncode,
            "log_tail": server.log_tail(30),
            "server_log": str(server.log),
        }
        self._record(f"fault-{name}", "soak-fault", data, server.argv)


def _released(before: Mapping[str, float], after: Mapping[str, float], within_mib: float) -> bool:
    """Whether every GPU's memory used is back within ``within_mib`` of ``before``."""
    return all(after.get(gpu, math.inf) - used <= within_mib for gpu, used in before.items())


def run_churn(
    port: int,
    model: str,
    churn: Churn,
    vocab: int,
    duration_s: float,
    checkpoint: Callable[[], dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``churn.clients`` threads send requests for ``duration_s``; ``checkpoint()`` is taken
    after ``churn.first_checkpoint`` of it and once every client is done. Each client
    draws its requests from its own seeded RNG, so a run's requests depend only on the
    profile (and on how many fit in the time)."""
    done: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()
    start = time.monotonic()
    end = start + duration_s

    def client(index: int) -> None:
        rng = random.Random(churn.seed * 1000 + index)
        while not stop.is_set() and time.monotonic() < end:
            prompt_len = rng.randint(*churn.prompt_len)
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            max_tokens = rng.randint(*churn.max_tokens)
            stream = rng.random() < churn.stream_fraction
            drop = stream and rng.random() < churn.drop_fraction and max_tokens > 1
            drop_after = rng.randint(1, max_tokens - 1) if drop else None
            sent = time.monotonic() - start
            reply = post(
                port, completion_body(model, prompt, max_tokens, churn.temperature, stream),
                churn.request_timeout_s, stream=stream, drop_after=drop_after,
            )  # fmt: skip
            del reply["text"]
            reply.update(client=index, sent_s=round(sent, 3), prompt_len=prompt_len,
                         max_tokens=max_tokens)  # fmt: skip
            with lock:
                done.append(reply)

    threads = [
        threading.Thread(target=client, args=(i,), daemon=True, name=f"soak-client-{i}")
        for i in range(churn.clients)
    ]

    def snapshot() -> dict[str, Any]:
        with lock:
            count = len(done)
        return {"at_s": round(time.monotonic() - start, 1), "requests": count, **checkpoint()}

    checkpoints = []
    try:
        for thread in threads:
            thread.start()
        stop.wait(churn.first_checkpoint * duration_s)
        checkpoints.append(snapshot())
        for thread in threads:
            thread.join()
        checkpoints.append(snapshot())
    finally:
        stop.set()
    return sorted(done, key=lambda r: r["sent_s"]), checkpoints


def log_errors(log: Path, marks: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """:data:`LOG_ERRORS` counts per phase of a server log (``marks``: the log's size at
    the end of each phase, in order), with the first few lines of each."""
    data = log.read_bytes() if log.exists() else b""
    out, begin = {}, 0
    for phase, end in marks.items():
        text = data[begin:end].decode(errors="replace")
        found = {key: pattern.findall(text) for key, pattern in LOG_ERRORS.items()}
        out[phase] = {
            **{key: len(lines) for key, lines in found.items()},
            "examples": [line.strip()[:300] for line in found["error_lines"][:5]],
        }
        begin = end
    return out


# --- the goal checks ------------------------------------------------------------------------------


def _check_row(status: str, detail: str, **numbers: Any) -> dict[str, Any]:
    return {"status": status, "detail": detail, **numbers}


def _quantiles(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0], "max": values[0]}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(q[49], 1), "p90": round(q[89], 1), "p99": round(q[98], 1),
            "max": max(values)}  # fmt: skip


def churn_summary(requests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts of a churn's requests and the latencies of the streamed ones, ms."""
    streamed = [r for r in requests if r["stream"]]
    answered = [r for r in requests if r["status"] == 200 and not r["error"]]
    failed = [r for r in requests if r["status"] >= 500 or r["error"]]
    return {
        "requests": len(requests),
        "answered": len(answered),
        "streamed": len(streamed),
        "dropped": sum(bool(r["dropped"]) for r in requests),
        "status_4xx": sum(400 <= r["status"] < 500 for r in requests),
        "server_errors": len(failed),
        "first_errors": [f"{r['status']}: {r['error'] or r.get('body', '')}" for r in failed[:5]],
        "ttft_ms": _quantiles([r["ttft_ms"] for r in streamed if "ttft_ms" in r]),
        "gap_ms": _quantiles([g for r in streamed for g in r.get("gaps_ms", [])]),
    }


def _growth(first: float, last: float) -> float:
    return (last - first) / first if first else (0.0 if last == first else math.inf)


def _flat(data: Mapping[str, Any], goals: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """GPU memory, and locked/pinned host bytes, between the two checkpoints."""
    points = data.get("checkpoints") or []
    within = goals["flat_within"]
    if len(points) < 2:
        missing = _check_row(NOT_MEASURED, "fewer than two checkpoints (the churn was cut)")
        return {"gpu_memory_flat": missing, "pinned_flat": missing}
    first, last = points[0], points[-1]
    if first["gpu_mib"] is None or last["gpu_mib"] is None:
        gpu = _check_row(NOT_MEASURED, "no NVML")
    else:
        growth = {g: _growth(first["gpu_mib"][g], last["gpu_mib"].get(g, 0.0))
                  for g in first["gpu_mib"]}  # fmt: skip
        worst = max(growth.values(), key=abs, default=0.0)
        gpu = _check_row(
            PASS if abs(worst) <= within else FAIL,
            ", ".join(f"GPU {g}: {first['gpu_mib'][g]:.0f} -> {last['gpu_mib'].get(g, 0):.0f} "
                      f"MiB ({growth[g]:+.2%})" for g in growth),
            growth=worst,
        )  # fmt: skip
    a, b = first["host"], last["host"]
    rss = _growth(a["rss_bytes"], b["rss_bytes"])
    pinned = (a["locked_bytes"] + a["pinned_bytes"], b["locked_bytes"] + b["pinned_bytes"])
    rss_text = (f"host RSS {a['rss_bytes'] / 2**30:.2f} -> {b['rss_bytes'] / 2**30:.2f} GiB "
                f"({rss:+.2%})")  # fmt: skip
    used = (first.get("host_used_bytes"), last.get("host_used_bytes"))
    if pinned == (0, 0) and None in used:
        host = _check_row(
            NOT_MEASURED,
            "VmLck and VmPin read 0 in every process of the server (the kernel accounts no "
            f"locked or pinned pages to it) and /proc/meminfo was not read; {rss_text}",
            rss_growth=rss,
        )
    elif pinned == (0, 0):
        held = _growth(*used)
        host = _check_row(
            PASS if abs(held) <= within else FAIL,
            "VmLck and VmPin read 0 (CUDA's pinned pages are not accounted to the process), "
            f"so host memory in use, system-wide: {used[0] / 2**30:.2f} -> "
            f"{used[1] / 2**30:.2f} GiB ({held:+.2%}); {rss_text}",
            growth=held, rss_growth=rss,
        )  # fmt: skip
    else:
        held = _growth(*pinned)
        host = _check_row(
            PASS if abs(held) <= within else FAIL,
            f"locked+pinned {pinned[0] / 2**30:.2f} -> {pinned[1] / 2**30:.2f} GiB "
            f"({held:+.2%}); {rss_text}",
            growth=held, rss_growth=rss,
        )  # fmt: skip
    return {"gpu_memory_flat": gpu, "pinned_flat": host}


#: The goal checks of an arm, as the summary names them.
CHECKS = {
    "startup": "the server starts",
    "requests": "requests answered during the churn (at least the goal)",
    "server_errors": "no server-side errors (5xx, connection errors, logged exceptions)",
    "bad_requests": "every bad request answered 4xx with a message, the server healthy after",
    "route_error": "the pool's route_error gauge stays 0",
    "gpu_memory_flat": "GPU memory flat between the checkpoints",
    "pinned_flat": "locked/pinned host bytes flat between the checkpoints (host RSS reported)",
    "greedy_equal": "greedy texts after the churn equal to the resident arm's",
    "sigterm": "exit after SIGTERM in time, GPU memory released",
}


def arm_checks(
    data: Mapping[str, Any], reference: Mapping[str, Any] | None
) -> dict[str, dict[str, Any]]:
    """The goal checks of one arm's record (``reference``: the resident arm's)."""
    goals = data["goals"]
    if data.get("state") != "ok":
        why = f"the server did not start ({data.get('state', 'cut before /health')})"
        if data.get("exception"):
            why += f": {data['exception']}"
        return {key: _check_row(FAIL if key == "startup" else NOT_MEASURED, why)
                for key in CHECKS}  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    out["startup"] = _check_row(
        PASS, f"healthy after {data['startup_s']} s, attention {data['attention_backend']}"
    )
    if "requests" not in data:
        cut = _check_row(NOT_MEASURED, "the churn did not end (the run was cut)")
        out.update(requests=cut, server_errors=cut)
    else:
        out.update(_served(data))
    out["bad_requests"] = _bad_requests_check(data)
    out["route_error"] = _route_error(data)
    out.update(_flat(data, goals))
    out["greedy_equal"] = _greedy_check(data, reference)
    out["sigterm"] = _sigterm_check(data, goals)
    return out


def _served(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The churn's requests and the server-side errors up to its end."""
    goals = data["goals"]
    churn = churn_summary(data["requests"])
    out: dict[str, dict[str, Any]] = {}
    out["requests"] = _check_row(
        PASS if churn["answered"] >= goals["min_requests"] else FAIL,
        f"{churn['answered']} of {churn['requests']} answered in {data.get('churn_s')} s "
        f"({churn['streamed']} streamed, {churn['dropped']} dropped, {churn['status_4xx']} 4xx)",
        answered=churn["answered"],
    )
    logged = data.get("log_errors") or {}
    in_service = sum(logged.get(phase, {}).get(key, 0)
                     for phase in ("startup", "serving") for key in LOG_ERRORS)  # fmt: skip
    greedy = [g for g in data.get("greedy_before", []) + data.get("greedy_after", [])
              if g["status"] != 200 or g["error"]]  # fmt: skip
    errors = churn["server_errors"] + len(greedy) + in_service
    later = ", ".join(
        f"{sum(logged[phase].get(k, 0) for k in LOG_ERRORS)} in the {phase.replace('_', ' ')}"
        for phase in ("bad_requests", "shutdown") if phase in logged
    )  # fmt: skip
    first = f" {churn['first_errors']}" if churn["first_errors"] else ""
    out["server_errors"] = _check_row(
        PASS if errors == 0 else FAIL,
        f"{churn['server_errors']} churn requests with 5xx or a connection error{first}, "
        f"{len(greedy)} failed greedy requests, {in_service} tracebacks or ERROR lines in the "
        f"log up to the end of the churn (later: {later or 'not read'})",
        count=errors,
    )
    return out


def _bad_requests_check(data: Mapping[str, Any]) -> dict[str, Any]:
    bad = data.get("bad_requests")
    if bad is None:
        return _check_row(NOT_MEASURED, "not sent (the run was cut)")
    wrong = [f"{b['kind']}: {b['status']} {b['body'] or b['error']!r}" for b in bad
             if not (400 <= b["status"] < 500 and error_message(b["body"]))]  # fmt: skip
    health = data.get("health_after_bad_requests")
    return _check_row(
        PASS if not wrong and health == 200 else FAIL,
        f"{len(bad) - len(wrong)} of {len(bad)} answered 4xx with a message"
        + (f"; not: {wrong}" if wrong else "")
        + f"; /health afterwards: {health}",
    )


def _route_error(data: Mapping[str, Any]) -> dict[str, Any]:
    """The route-error gauge at the last checkpoint, with the pool's counters between
    the two (:func:`harness.e2e.pool_metrics`)."""
    if data["offload"] != "pool":
        return _check_row(NOT_MEASURED, "no pool on this arm")
    scraped = [p["pool_metrics"] for p in data.get("checkpoints") or [] if p.get("pool_metrics")]
    gauge = e2e.POOL_METRICS + "route_error"
    if not scraped or not any(k.partition("{")[0] == gauge for k in scraped[-1]):
        return _check_row(NOT_MEASURED, f"no {gauge} in /metrics")
    over = e2e.pool_metrics(scraped[0], scraped[-1])
    assert over is not None
    return _check_row(
        PASS if over["route_error"] == 0 else FAIL,
        f"route_error {over['route_error']:g}; between the checkpoints {over['hits']} hits, "
        f"{over['misses']} misses"
        + (f", {over['layers']} pooled layers" if over["layers"] is not None else ""),
        value=over["route_error"],
    )


def _greedy_check(data: Mapping[str, Any], reference: Mapping[str, Any] | None) -> dict[str, Any]:
    if data["offload"] == "none":
        return _check_row(NOT_MEASURED, "this is the reference arm")
    if reference is None or not reference.get("greedy_after"):
        return _check_row(NOT_MEASURED, "no resident arm's greedy texts in this folder")
    mine, theirs = data.get("greedy_after") or [], reference["greedy_after"]
    if not mine:
        return _check_row(NOT_MEASURED, "no greedy texts after the churn (the run was cut)")
    same = [a["text"] == b["text"] and a["status"] == 200
            for a, b in zip(mine, theirs, strict=False)]  # fmt: skip
    stable = [a["text"] == b["text"]
              for a, b in zip(data.get("greedy_before") or [], mine, strict=False)]  # fmt: skip
    return _check_row(
        PASS if same and all(same) and len(mine) == len(theirs) else FAIL,
        "per prompt: "
        + ", ".join("equal" if s else "differ" for s in same)
        + "; the arm's own texts before and after the churn: "
        + ", ".join("equal" if s else "differ" for s in stable),
        equal=same,
    )


def _sigterm_check(data: Mapping[str, Any], goals: Mapping[str, Any]) -> dict[str, Any]:
    down = data.get("shutdown")
    if down is None:
        return _check_row(NOT_MEASURED, "no SIGTERM was sent (the run was cut)")
    if not down["alive_at_signal"]:
        return _check_row(FAIL, "the server had exited before the signal")
    exit_s = down["exit_s"]
    in_time = exit_s is not None and exit_s <= goals["exit_within_s"]
    before, after = data.get("gpu_mib_before_start"), down["gpu_mib_after_exit"]
    said = (f"{down['streaming_at_signal']} of {down['in_flight']} requests streaming; every "
            + (f"process gone {exit_s} s after SIGTERM" if exit_s is not None else
               "process not gone: SIGKILL was needed"))  # fmt: skip
    if before is None or after is None:
        status = FAIL if not in_time else NOT_MEASURED
        return _check_row(status, f"{said}; GPU memory not measured (no NVML)", exit_s=exit_s)
    released = _released(before, after, goals["gpu_released_within_mib"])
    said += f"; GPU memory before the start {before}, after the exit {after} MiB"
    host = (data.get("host_used_before_start"), down.get("host_used_after_exit"))
    if None not in host:
        kept_mib = (host[1] - host[0]) / 2**20
        released = released and kept_mib <= goals["host_released_within_mib"]
        said += f"; host memory in use {kept_mib:+.0f} MiB from before the start"
    return _check_row(PASS if in_time and released else FAIL, said, exit_s=exit_s)


def fault_check(data: Mapping[str, Any]) -> dict[str, Any]:
    """Whether a start-up fault did what the tree says it does."""
    seen, expected = data["observed"], data["expected"]["outcome"]
    if seen["outcome"] == "not run":
        return _check_row(NOT_MEASURED, seen["reason"])
    said = (f"{seen['outcome']} after {seen['seconds']} s, weights "
            f"{'loaded' if seen['weights_loaded'] else 'not loaded'}, message "
            f"{'as expected' if seen['message_matches'] else 'not the expected one'}: "
            f"{seen['message'][:200]!r}")  # fmt: skip
    if expected == FAILS:
        ok = seen["outcome"] == "fails" and not seen["weights_loaded"] and seen["message_matches"]
    else:
        ok = seen["outcome"] == "starts" and seen["message_matches"]
    return _check_row(PASS if ok else FAIL, said)


# --- the summary ----------------------------------------------------------------------------------


def summarize(folder: Path) -> dict[str, Any]:
    """``summary.json`` of a folder: each arm's and fault's checks, what was planned and
    not measured, and the first result's provenance."""
    records = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        if str(record.get("kind", "")).startswith("soak-") and path.name != "summary.json":
            records.append(record)
    arms = {r["data"]["arm"]: r["data"] for r in records if r["kind"] == "soak-arm"}
    faults = {r["data"]["fault"]: r["data"] for r in records if r["kind"] == "soak-fault"}
    planned: dict[str, set[str]] = {"arms": set(), "faults": set()}
    for r in records:
        if r["kind"] == "soak-plan":
            for key in planned:
                planned[key].update(r["data"][key])
    reference = next((a for a in arms.values() if a["offload"] == "none"), None)
    provenance = next(({k: v for k, v in r["provenance"].items() if k != "server_argv"}
                       for r in records), {})  # fmt: skip
    return {
        "schema": results.SCHEMA,
        "kind": "soak-summary",
        "profile": next((r["data"]["profile"] for r in records), None),
        "arms": {
            name: {
                "offload": data["offload"],
                "complete": data["complete"],
                "startup_s": data.get("startup_s"),
                "churn": churn_summary(data.get("requests") or []),
                "checks": arm_checks(data, reference),
            }
            for name, data in arms.items()
        },
        "faults": {
            name: {
                "expected": data["expected"],
                "observed": {k: v for k, v in data["observed"].items() if k != "log_tail"},
                "check": fault_check(data),
            }
            for name, data in faults.items()
        },
        "not_measured": sorted(
            [f"arm {a}" for a in planned["arms"] if not arms.get(a, {}).get("complete")]
            + [f"fault {f}" for f in planned["faults"] if f not in faults]
        ),
        "provenance": provenance,
    }


def _latency_cell(churn: Mapping[str, Any]) -> str:
    """Time to the first chunk and gaps between chunks of the churn's streamed requests."""
    ttft, gap = churn.get("ttft_ms"), churn.get("gap_ms")
    if not ttft or not gap:
        return "not measured"
    return (f"time to first token {ttft['p50'] / 1000:.2f} / {ttft['p99'] / 1000:.2f} s, "
            f"inter-token {gap['p50']:.0f} / {gap['p99']:.0f} ms")  # fmt: skip


def summary_markdown(summary: Mapping[str, Any]) -> str:
    """The goal checks as tables (``summary.md``)."""
    arms = summary["arms"]
    lines = [
        f"# Soak: {summary['profile']}",
        "",
        "Written by `python -m harness replay soak` from the result files beside it",
        "(`summary.json`; `--summarize DIR` writes both again). Each check is pass, fail",
        "or not measured, with its numbers.",
        "",
    ]
    if arms:
        lines += ["| check | " + " | ".join(arms) + " |", "|" + " --- |" * (len(arms) + 1)]
    else:
        lines.append("No arm was served in this folder (start-up faults only).")
    for key, what in CHECKS.items() if arms else ():
        cells = []
        for arm in arms.values():
            check = arm["checks"][key]
            cells.append(f"**{check['status']}**: {check['detail']}".replace("|", "\\|"))
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    if arms:
        lines.append("| churn latency, p50 / p99 (reported, no goal) | " + " | ".join(
            _latency_cell(arm.get("churn") or {}) for arm in arms.values()
        ) + " |")  # fmt: skip
    lines += ["", "## Start-up faults", "",
              "| fault | expected | observed | check |", "| --- | --- | --- | --- |"]  # fmt: skip
    for name, fault in summary["faults"].items():
        check = fault["check"]
        detail = check["detail"].replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {name} | {fault['expected']['outcome']} | {fault['observed']['outcome']} "
            f"| **{check['status']}**: {detail} |"
        )
    if summary["not_measured"]:
        lines += ["", "Planned and not measured: " + ", ".join(summary["not_measured"]) + "."]
    return "\n".join(lines) + "\n"


def write_summary(folder: Path) -> list[Path]:
    """``summary.json`` and ``summary.md`` of a soak folder; returns them."""
    summary = summarize(folder)
    path = folder / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    table = folder / "summary.md"
    table.write_text(summary_markdown(summary))
    return [path, table]


# --- the command ----------------------------------------------------------------------------------


def main(
    profile_name: str,
    out: Path,
    *,
    python: Path,
    vllm_command: Sequence[str] = (),
    arms: Sequence[str] = (),
    checkpoint_dir: Path | None = None,
    faults: Sequence[str] | None = None,
    churn_s: float | None = None,
    dry_run: bool = False,
    deadline_s: float | None = None,
    argv: Sequence[str] = (),
) -> int:
    """``python -m harness replay soak``: see the module docstring. ``faults`` (a list,
    empty for the profile's) runs the start-up faults instead of the arms; ``churn_s``
    replaces the profile's churn duration."""
    started = time.monotonic()
    if deadline_s is not None and deadline_s <= 0:
        raise HarnessError(f"--deadline-s must be a positive number of seconds, not {deadline_s}")
    profiles = load_profiles()
    if profile_name not in profiles:
        raise HarnessError(f"unknown soak profile {profile_name!r}; known: {', '.join(profiles)}")
    profile = profiles[profile_name]
    if churn_s is not None:
        if churn_s <= 0:
            raise HarnessError(f"--churn-s must be a positive number of seconds, not {churn_s}")
        profile = dataclasses.replace(
            profile, churn=dataclasses.replace(profile.churn, duration_s=churn_s)
        )
    if faults is not None and arms:
        raise HarnessError("--faults starts the fault servers instead of the arms; drop --arms")
    arm_names = [] if faults is not None else list(arms) or list(profile.arms)
    fault_names = [] if faults is None else list(faults) or list(profile.faults)
    unknown = [a for a in arm_names if a not in profile.e2e.arms]
    unknown += [f for f in fault_names if f not in FAULTS]
    if unknown:
        raise HarnessError(
            f"profile {profile_name}: unknown {unknown}; arms: {', '.join(profile.e2e.arms)}; "
            f"faults: {', '.join(FAULTS)}"
        )
    spec = profile.e2e.checkpoint_spec()
    ckpt = checkpoint_dir or out / "checkpoint"
    runner = Runner(
        profile, out, list(vllm_command) or [str(python.parent / "vllm")],
        str(ckpt / profile.router), spec,
        env={"VLLM_LOG_STATS_INTERVAL": str(profile.e2e.measure.stats_interval_s)},
        dry_run=dry_run,
        deadline=None if dry_run else e2e.run_deadline(started, deadline_s, os.environ),
    )  # fmt: skip
    if dry_run:
        print(f"# {profile.description}")
        print(f"# python -m harness checkpoint {ckpt} --preset {profile.e2e.preset}"
              f" --routers {profile.router}")  # fmt: skip
        print(f"# every server: {shlex.join(f'{k}={v}' for k, v in runner.env.items())}")
        runner.run(arm_names, fault_names)
        return 0
    checkpoint_routed.write(ckpt, spec, [profile.router], echo=progress)
    runner.nvml = replay.load_nvml()
    runner.provenance = replay.server_provenance(python, argv)
    try:
        runner.run(arm_names, fault_names)
    finally:  # a run stopped by a time limit (SIGINT) still leaves its summary
        for path in write_summary(out):
            print(path)
    return 0
