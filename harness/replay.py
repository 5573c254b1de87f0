"""Stage 7: replay the seeds' end-to-end serving claims (``python -m harness replay``).

One command per experiment::

    python -m harness replay ttft   --profile glm53-tp2      # TTFT at 12.5K / 81.6K per arm
    python -m harness replay decode --profile glm53-tp2      # decode tok/s, MTP acceptance
    python -m harness replay oom    --profile b12x-qwen36    # does the server start?
    python -m harness replay ttft   --profile tiny-synthetic # any CUDA GPU, no download
    python -m harness replay plot   --out DIR                # TTFT by arm and input length

A *profile* (``harness/data/replay_profiles.toml``) is one seed's setup: the
``vllm serve`` options shared by every arm, the arms (what the seed compared:
prefill staging on/off, custom all-reduce on/off, ``--max-num-batched-tokens``)
and, per experiment, the arms, input lengths, output length, runs and warm-ups.
``--dry-run`` prints every command without starting anything.

vLLM's CLI is the ``vllm`` script next to the server's Python. Where vLLM is
not installed but put on ``PYTHONPATH`` (the device bundle, see
``docs/device-bundle.md``) there is no such script: ``--vllm-command "python3 -m
vllm.entrypoints.cli.main"`` then runs both ``vllm serve`` and ``vllm bench
serve``, and ``--python`` names the interpreter whose versions are recorded.

For each arm the runner starts ``vllm serve`` from the harness venv (the built
wheel of the series, installed by :func:`harness.venv.install_wheel`; ``--python``
selects another venv, e.g. the stock release for an A/B), in its own process
group, waits for ``/health`` (bounded), then drives it with vLLM's own client,
``vllm bench serve``: random dataset, exact input length (``--random-range-ratio
0``), streaming completions, ``--ignore-eos`` with a fixed output length,
``--temperature 0``, one request at a time. While each run executes, a thread
samples GPU power, PCIe throughput, memory and utilization through NVML. Every
run becomes one result file (:func:`harness.results.write`) holding the bench
JSON, the NVML samples and their summary, the full server and bench argv, and
the provenance (including the server's vLLM and torch versions).

Design decisions:

* **Warm-ups are separate bench invocations.** ``vllm bench serve
  --num-warmups`` replays the *first measured prompt*, which with prefix caching
  turns the first measured TTFT into a cache hit. So each input length is warmed
  up by its own run (discarded), and every bench run in a server's life uses its
  own ``--seed``: the random dataset builds a prompt as consecutive token ids
  from a seeded offset, so equal seeds would give a 81.6K prompt the 12.5K
  prompt as its prefix.
* **No client of our own.** ``vllm bench serve`` already measures TTFT, TPOT,
  ITL and E2EL with a streaming client, and its ``spec_decode_*`` fields are the
  MTP acceptance over the run (it scrapes ``/metrics`` before and after). What it
  cannot see is the server's cumulative counters "since the last restart" (the
  seed's MTP figure, warm-ups included): the runner scrapes the ``vllm:spec_decode*``
  counters of ``/metrics`` once after startup and once before shutdown
  (:func:`scrape_spec_decode`), a plain GET, no streaming.
* **Decode tok/s** is ``1000 / mean_tpot_ms``, i.e. (output tokens - 1) /
  (latency - TTFT) per request, averaged over the run's requests as vLLM's TPOT.
* **The server is always stopped**: SIGTERM to its process group, then SIGKILL
  after a bounded wait, on success, on bench failure, on a health timeout and on
  Ctrl-C. The bench process gets the same treatment.
* **OOM is a result.** ``oom`` starts the server and records ``ok`` (healthy),
  ``oom`` (the log shows a CUDA out-of-memory error) or ``error`` (any other
  exit or a health timeout), with the exception text from the log, the memory
  NVML saw last, and vLLM's "Model loading took" / "Available KV cache memory"
  lines.

This module imports only the standard library; NVML comes from
``vllm.third_party.pynvml`` or ``pynvml`` when importable, and matplotlib only
inside :func:`plot_ttft`. When NVML is missing in the interpreter that runs the
harness, the CLI re-runs itself under the harness venv's Python, which has it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness import results
from harness.project import HarnessError, Project, progress

PROFILES = Path(__file__).resolve().parent / "data" / "replay_profiles.toml"
EXPERIMENTS = ("ttft", "decode", "oom")
SYNTHETIC = "synthetic"  # profile model value: generate harness.checkpoint's model


# --- profiles -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """``vllm serve`` options a profile can set; ``None`` leaves vLLM's default."""

    model: str
    tensor_parallel_size: int | None = None
    data_parallel_size: int | None = None
    moe_backend: str | None = None
    attention_backend: str | None = None  # e.g. TRITON_ATTN where FlashAttention is missing
    moe_expert_pool_rows: int | None = None
    moe_expert_pool_gb: float | None = None  # all the pool keeps on the GPU, in GiB
    prefill_staging: bool | None = None  # False: --no-moe-expert-pool-prefill-staging
    moe_expert_pool_admission: str | None = None  # "every-miss" or "frequency" (series 0015)
    custom_all_reduce: bool | None = None  # False: --disable-custom-all-reduce
    kv_cache_dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    cudagraph_mode: str | None = None  # as --compilation-config '{"cudagraph_mode": ...}'
    speculative_config: Mapping[str, Any] | None = None
    trust_remote_code: bool = False
    extra_args: tuple[str, ...] = ()

    def argv(self, model: str | None = None) -> list[str]:
        """The arguments after ``vllm serve`` (``model`` replaces the profile's model)."""
        args = [model or self.model]
        valued = (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--data-parallel-size", self.data_parallel_size),
            ("--moe-backend", self.moe_backend),
            ("--attention-backend", self.attention_backend),
            ("--moe-expert-pool-rows", self.moe_expert_pool_rows),
            ("--moe-expert-pool-gb", self.moe_expert_pool_gb),
            ("--moe-expert-pool-admission", self.moe_expert_pool_admission),
            ("--kv-cache-dtype", self.kv_cache_dtype),
            ("--max-model-len", self.max_model_len),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--gpu-memory-utilization", self.gpu_memory_utilization),
        )
        for flag, value in valued:
            if value is not None:
                args += [flag, str(value)]
        if self.prefill_staging is False:
            args.append("--no-moe-expert-pool-prefill-staging")
        if self.custom_all_reduce is False:
            args.append("--disable-custom-all-reduce")
        if self.cudagraph_mode is not None:
            args += ["--compilation-config", json.dumps({"cudagraph_mode": self.cudagraph_mode})]
        if self.speculative_config is not None:
            args += ["--speculative-config", json.dumps(dict(self.speculative_config))]
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        return args + list(self.extra_args)


@dataclasses.dataclass(frozen=True)
class ExperimentPlan:
    """What one experiment runs on a profile."""

    arms: tuple[str, ...]
    input_lens: tuple[int, ...] = ()
    output_len: int = 16
    runs: int = 3
    prompts: int = 1
    warmups: int = 1


@dataclasses.dataclass(frozen=True)
class Profile:
    """One seed's setup: shared server options, arms and experiments."""

    name: str
    description: str
    seed: str
    server: Mapping[str, Any]
    arms: Mapping[str, Mapping[str, Any]]
    experiments: Mapping[str, ExperimentPlan]
    startup_timeout_s: float = 1800.0
    bench_timeout_s: float = 3600.0

    def options(self, arm: str) -> ServerOptions:
        if arm not in self.arms:
            raise HarnessError(f"profile {self.name} has no arm {arm!r} (has {sorted(self.arms)})")
        merged = {**self.server, **self.arms[arm]}
        if "extra_args" in merged:
            merged["extra_args"] = tuple(merged["extra_args"])
        try:
            return ServerOptions(**merged)
        except TypeError as exc:
            raise HarnessError(f"profile {self.name}, arm {arm}: {exc}") from exc

    def plan(self, experiment: str) -> ExperimentPlan:
        if experiment not in self.experiments:
            raise HarnessError(f"profile {self.name} defines no {experiment!r} experiment")
        return self.experiments[experiment]


def load_profiles(path: Path = PROFILES) -> dict[str, Profile]:
    """Every profile in ``path``, checked (unknown keys and arms are errors)."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise HarnessError(f"cannot read {path}: {exc}") from exc
    known = {f.name for f in dataclasses.fields(ExperimentPlan)}
    profiles = {}
    for name, body in data.items():
        experiments = {}
        for exp, plan in body.get("experiments", {}).items():
            if exp not in EXPERIMENTS or set(plan) - known:
                raise HarnessError(f"{path}: {name}.experiments.{exp} is not valid")
            kwargs: dict[str, Any] = {
                k: tuple(v) if isinstance(v, list) else v for k, v in plan.items()
            }
            experiments[exp] = ExperimentPlan(**kwargs)
        profile = Profile(
            name=name,
            description=body.get("description", ""),
            seed=body.get("seed", ""),
            server=body["server"],
            arms=body.get("arms", {}),
            experiments=experiments,
            startup_timeout_s=float(body.get("startup_timeout_s", 1800)),
            bench_timeout_s=float(body.get("bench_timeout_s", 3600)),
        )
        for plan in experiments.values():
            for arm in plan.arms:
                profile.options(arm)  # raises on unknown arms or options
        profiles[name] = profile
    return profiles


# --- commands -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """One ``vllm bench serve`` invocation."""

    input_len: int
    output_len: int
    prompts: int
    seed: int
    result_dir: Path
    result_file: str
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    run: int = 0  # 1.. for measured runs, 0 for a warm-up
    concurrency: int = 1  # --max-concurrency; the prompts are sent at once
    temperature: float = 0.0  # 0: greedy
    # Poisson arrivals at this many requests per second (--request-rate, --burstiness 1);
    # None: every prompt at once
    request_rate: float | None = None
    # (input, output) --random-range-ratio: lengths drawn uniformly around input_len and
    # output_len; None: every request exactly input_len and output_len
    range_ratio: tuple[float, float] | None = None


def length_range(low: int, high: int) -> tuple[int, float]:
    """``(length, range_ratio)`` for which ``vllm bench serve``'s random dataset draws
    lengths uniformly from ``[low, high]``: it draws from ``floor(length * (1 - r))`` to
    ``ceil(length * (1 + r))`` (an odd ``low + high`` loses one length at one end; the
    input length also loses the tokenizer's special tokens)."""
    if not 0 < low <= high:
        raise HarnessError(f"a length range needs 0 < low <= high, not [{low}, {high}]")
    mid = (low + high) // 2
    ratio = min(mid - low, high - mid) / mid
    return mid, max(0.0, ratio - 1e-9)  # a hair inside, so that rounding keeps the ends


def serve_argv(vllm: Sequence[str], options: ServerOptions, model: str, port: int) -> list[str]:
    """The full ``vllm serve`` command."""
    return [*vllm, "serve", *options.argv(model), "--host", "127.0.0.1", "--port", str(port)]


def bench_argv(vllm: Sequence[str], model: str, port: int, run: BenchRun) -> list[str]:
    """The full ``vllm bench serve`` command of one run (``run.concurrency`` requests at a time)."""
    ratio = "0"
    if run.range_ratio is not None:
        ratio = json.dumps({"input": run.range_ratio[0], "output": run.range_ratio[1]})
    arrivals = ["inf"]
    if run.request_rate is not None:
        arrivals = [f"{run.request_rate:g}", "--burstiness", "1"]
    argv = [
        *vllm, "bench", "serve",
        "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}",
        "--endpoint", "/v1/completions",
        "--model", model,
        "--tokenizer", model,
        "--dataset-name", "random",
        "--random-input-len", str(run.input_len),
        "--random-output-len", str(run.output_len),
        "--random-range-ratio", ratio,
        "--random-prefix-len", "0",
        "--num-prompts", str(run.prompts),
        "--max-concurrency", str(run.concurrency),
        "--request-rate", *arrivals,
        "--ignore-eos",
        "--temperature", f"{run.temperature:g}",
        "--num-warmups", "0",
        "--seed", str(run.seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir", str(run.result_dir),
        "--result-filename", run.result_file,
    ]  # fmt: skip
    if run.metadata:
        argv += ["--metadata", *(f"{k}={v}" for k, v in run.metadata.items())]
    return argv


#: Prefixes of inherited environment variables that change how a server runs;
#: each result records them (``TORCH_COMPILE_DISABLE``, ``VLLM_*`` switches, ...).
SERVER_ENV_PREFIXES = ("VLLM_", "TORCH_", "PYTORCH_", "CUDA_", "NCCL_", "TRITON_", "HF_")


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` with a :data:`SERVER_ENV_PREFIXES` prefix, sorted."""
    return {k: environ[k] for k in sorted(environ) if k.startswith(SERVER_ENV_PREFIXES)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- NVML -----------------------------------------------------------------------------------------


def load_nvml() -> Any | None:
    """vLLM's bundled pynvml, else ``pynvml``, initialized; ``None`` if neither works."""
    for name in ("vllm.third_party.pynvml", "pynvml"):
        try:
            module = importlib.import_module(name)
            module.nvmlInit()
        except Exception:  # ImportError, or an NVMLError when there is no driver
            continue
        return module
    return None


class NvmlSampler:
    """Samples every GPU in a background thread until :meth:`stop`.

    Per sample and GPU: power (W), PCIe TX/RX throughput (KB/s, NVML's unit),
    memory used (MiB) and GPU utilization (%). A field NVML refuses is ``None``.
    The timestamp ``t`` is ``time.perf_counter()``, the clock ``vllm bench serve``
    stamps its requests with (CLOCK_MONOTONIC on Linux, shared by processes), so
    samples can be split into each request's prefill and decode (:func:`phases`).
    """

    def __init__(
        self, nvml: Any, interval_s: float = 0.5, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.nvml = nvml
        self.interval_s = interval_s
        self.clock = clock
        count = int(nvml.nvmlDeviceGetCount())
        self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _read(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported and friends
            return None

    def sample(self) -> list[dict[str, Any]]:
        """One row per GPU, appended to :attr:`samples` and returned."""
        nvml, now, read = self.nvml, self.clock(), self._read
        rows = []
        for index, h in enumerate(self.handles):
            power_mw = read(nvml.nvmlDeviceGetPowerUsage, h)
            memory = read(nvml.nvmlDeviceGetMemoryInfo, h)
            util = read(nvml.nvmlDeviceGetUtilizationRates, h)
            rows.append(
                {
                    "t": now,
                    "gpu": index,
                    "power_w": power_mw / 1000.0 if power_mw is not None else None,
                    "pcie_tx_kb_s": read(
                        nvml.nvmlDeviceGetPcieThroughput, h, nvml.NVML_PCIE_UTIL_TX_BYTES
                    ),
                    "pcie_rx_kb_s": read(
                        nvml.nvmlDeviceGetPcieThroughput, h, nvml.NVML_PCIE_UTIL_RX_BYTES
                    ),
                    "mem_used_mib": memory.used / 2**20 if memory is not None else None,
                    "util_pct": util.gpu if util is not None else None,
                }
            )
        self.samples += rows
        return rows

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> NvmlSampler:
        self._thread = threading.Thread(target=self._loop, name="nvml-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        return self.samples


def phases(bench: Mapping[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Each request's prefill (send to first token) and decode (first to last token) window."""
    starts = bench.get("start_times") or []
    ttfts = bench.get("ttfts") or []
    latencies = bench.get("latencies") or []
    windows: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
    for start, ttft, latency in zip(starts, ttfts, latencies, strict=False):
        if start is None or not ttft:
            continue
        windows["prefill"].append((start, start + ttft))
        if latency and latency > ttft:
            windows["decode"].append((start + ttft, start + latency))
    return windows


def in_windows(
    samples: Sequence[Mapping[str, Any]], windows: Sequence[tuple[float, float]]
) -> list[Mapping[str, Any]]:
    """The samples taken inside any of ``windows``."""
    return [s for s in samples if any(a <= s["t"] <= b for a, b in windows)]


def summarize_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per GPU: sample count, mean and max of every numeric field."""
    by_gpu: dict[int, list[Mapping[str, Any]]] = {}
    for row in samples:
        by_gpu.setdefault(int(row["gpu"]), []).append(row)
    summary: dict[str, dict[str, Any]] = {}
    for gpu, rows in sorted(by_gpu.items()):
        entry: dict[str, Any] = {"samples": len(rows)}
        for key in ("power_w", "pcie_tx_kb_s", "pcie_rx_kb_s", "mem_used_mib", "util_pct"):
            values = [float(r[key]) for r in rows if r.get(key) is not None]
            entry[f"{key}_mean"] = sum(values) / len(values) if values else None
            entry[f"{key}_max"] = max(values) if values else None
        summary[str(gpu)] = entry
    return summary


# --- processes ------------------------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from ``/proc``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


def host_used_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """Host memory in use, system-wide (``MemTotal - MemAvailable``): it counts the pinned
    pages that ``VmLck``/``VmPin`` miss (CUDA's pinned allocations are not accounted to
    the process), and not the page cache, which is available. None where unreadable."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _wait_group(pgid: int, deadline: float) -> bool:
    while group_members(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """Stop ``proc`` and everything in its process group; return its exit code.

    SIGTERM to the group (also when the leader already exited: engine cores and
    TP workers may outlive it), up to ``timeout_s`` for every member to go, then
    SIGKILL and another bounded wait.
    """
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    if not _wait_group(pgid, deadline):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if not _wait_group(pgid, time.monotonic() + 10):
            raise HarnessError(f"process group {pgid} survived SIGKILL: {group_members(pgid)}")
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired as exc:  # pragma: no cover - a leader ignoring SIGKILL
        raise HarnessError(f"process {pgid} survived SIGKILL") from exc


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """Status and body of a GET (status 0 when nothing answers); never uses a proxy."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return int(response.status), response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), ""
    except (urllib.error.URLError, OSError):
        return 0, ""


class Server:
    """A ``vllm serve`` process in its own process group; a context manager that always stops it."""

    def __init__(
        self,
        argv: Sequence[str],
        port: int,
        log: Path,
        env: Mapping[str, str] | None = None,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.argv = list(argv)
        self.port = port
        self.log = log
        self.env = dict(env or {})
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        progress("$ " + shlex.join(self.argv))
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.returncode is None:
            self.returncode = stop_group(self.proc, self.stop_timeout_s)

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> str:
        """``"ok"`` once /health answers 200, ``"exited"`` or ``"timeout"`` otherwise."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return "exited"
            if http_get(self.url + "/health", timeout_s=min(5.0, poll_s + 1))[0] == 200:
                return "ok"
            time.sleep(poll_s)
        return "timeout"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape_metrics(url: str, prefix: str) -> dict[str, float] | None:
    """The ``/metrics`` samples whose name starts with ``prefix``, keyed by name and
    labels (``model_name`` and ``engine`` dropped, equal keys summed), or ``None``."""
    status, body = http_get(url + "/metrics")
    if status != 200:
        return None
    counters: dict[str, float] = {}
    for line in body.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or not match.group(1).startswith(prefix):
            continue
        labels = re.sub(r'(,?)(model_name|engine)="[^"]*"', "", match.group(2) or "")
        key = match.group(1) + (labels if labels not in ("{}", "{,}") else "")
        with contextlib.suppress(ValueError):
            counters[key] = counters.get(key, 0.0) + float(match.group(3))
    return counters


def scrape_spec_decode(url: str) -> dict[str, float] | None:
    """The ``vllm:spec_decode*`` counters of ``/metrics`` (:func:`scrape_metrics`)."""
    found = scrape_metrics(url, "vllm:spec_decode")
    if found is None:
        return None
    return {k: v for k, v in found.items() if k.partition("{")[0].endswith("_total")}


def spec_decode_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Acceptance rate and tokens per verify step between two scrapes (like ``vllm bench``)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("vllm:spec_decode_num_drafts_total", 0.0)
    drafted = delta.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    per_pos = {
        int(m.group(1)): v
        for k, v in delta.items()
        if (m := re.search(r'position="(\d+)"', k)) and "per_pos" in k
    }
    return {
        "counters": delta,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": 1 + accepted / drafts if drafts else None,
        "per_position_acceptance": [per_pos[p] / drafts for p in sorted(per_pos)] if drafts else [],
    }


# --- the runner -----------------------------------------------------------------------------------

OOM_PATTERNS = (
    re.compile(r"(?:torch\.)?(?:cuda\.)?OutOfMemoryError[^\n]*"),
    re.compile(r"CUDA out of memory[^\n]*"),
    re.compile(r"CUDA error: out of memory[^\n]*"),
)
ERROR_LINE = re.compile(r"^\S*(?:Error|Exception)\b[^\n]*|^RuntimeError[^\n]*|^ValueError[^\n]*")
LOG_FACTS = {
    "model_loading_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "available_kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "gpu_kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
}


def classify_failure(log_text: str) -> tuple[str, str]:
    """``("oom" | "error", exception text)`` from a server log that ended without serving."""
    for pattern in OOM_PATTERNS:
        found = pattern.findall(log_text)
        if found:
            return "oom", found[-1].strip()
    lines = [ln.strip() for ln in log_text.splitlines()]
    for line in reversed(lines):
        # vLLM prefixes worker output with "(EngineCore pid=...)": look past it.
        text = re.sub(r"^\([^)]*\)\s*", "", line)
        if ERROR_LINE.match(text):
            return "error", text
    return "error", lines[-1] if lines else "no output"


def log_facts(
    log_text: str, patterns: Mapping[str, re.Pattern[str]] = LOG_FACTS
) -> dict[str, list[float]]:
    """Every value of each pattern in a log (one per worker); vLLM's memory lines by default."""
    return {
        key: [float(v.replace(",", "")) for v in pattern.findall(log_text)]
        for key, pattern in patterns.items()
    }


@dataclasses.dataclass
class Runner:
    """Runs one experiment of one profile; every external effect goes through here."""

    profile: Profile
    experiment: str
    out: Path
    vllm: Sequence[str]  # vLLM's CLI: [venv/bin/vllm], [python3, -m, ...] or a test's fake
    model: str | None = None  # resolved model (the synthetic checkpoint's path)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    dry_run: bool = False
    port: int | None = None
    nvml: Any | None = None
    nvml_note: str = ""
    sample_interval_s: float = 0.5
    health_poll_s: float = 1.0
    stop_timeout_s: float = 30.0
    provenance: Callable[[], dict[str, Any]] = dataclasses.field(
        default_factory=lambda: results.provenance
    )
    echo: Callable[[str], None] = print
    written: list[Path] = dataclasses.field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.model or self.profile.server["model"]

    def run(self) -> list[Path]:
        plan = self.profile.plan(self.experiment)
        for arm in plan.arms:
            if self.experiment == "oom":
                self._oom(arm)
            else:
                self._serve_and_bench(arm, plan)
        return self.written

    # -- helpers

    def _server(self, arm: str) -> Server:
        port = self.port or (8000 if self.dry_run else free_port())
        argv = serve_argv(self.vllm, self.profile.options(arm), self.model_name, port)
        log = self.out / "logs" / f"{self.experiment}-{self.profile.name}-{arm}.server.log"
        return Server(argv, port, log, self.env, self.stop_timeout_s)

    def _record(
        self, name: str, kind: str, data: dict[str, Any], server: Server, bench: list[str] | None
    ) -> Path:
        prov = self.provenance()
        prov["server_argv"] = server.argv
        prov["bench_argv"] = bench
        prov["env"] = {**server_env(os.environ), **self.env}
        record = {
            "experiment": self.experiment,
            "profile": self.profile.name,
            "profile_seed": self.profile.seed,
            "model": self.model_name,
            **data,
        }
        path = results.write(self.out / f"{name}.json", kind, record, prov)
        self.written.append(path)
        progress(f"wrote {path}")
        return path

    def _bench(self, argv: list[str]) -> int:
        """Run one bench; kill its process group on any exit (Ctrl-C included)."""
        progress("$ " + shlex.join(argv))
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=self.profile.bench_timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise HarnessError(
                f"vllm bench serve ran past {self.profile.bench_timeout_s:.0f} s"
            ) from exc
        finally:
            stop_group(proc, self.stop_timeout_s)

    # -- ttft / decode

    def _serve_and_bench(self, arm: str, plan: ExperimentPlan) -> None:
        server = self._server(arm)
        raw = self.out / "raw"
        runs: list[tuple[BenchRun, bool]] = []
        # One seed per bench run of a server's life: vLLM's random dataset builds each
        # prompt as consecutive token ids from an offset drawn from the seed, so two
        # runs with one seed would share a prefix (a prefix-cache hit) across lengths.
        seeds = iter(range(1, 1 + len(plan.input_lens) * (plan.warmups + plan.runs)))
        for input_len in plan.input_lens:
            meta = {"profile": self.profile.name, "arm": arm, "experiment": self.experiment}
            for w in range(plan.warmups):
                runs.append((BenchRun(
                    input_len, plan.output_len, plan.prompts, next(seeds), raw,
                    f"warmup-{self.experiment}-{arm}-in{input_len}-{w}.json", meta,
                ), False))  # fmt: skip
            for r in range(1, plan.runs + 1):
                runs.append((BenchRun(
                    input_len, plan.output_len, plan.prompts, next(seeds), raw,
                    f"{self.experiment}-{arm}-in{input_len}-run{r}.json", {**meta, "run": str(r)},
                    run=r,
                ), True))  # fmt: skip
        if self.dry_run:
            self.echo(shlex.join(server.argv))
            for run, _ in runs:
                self.echo(shlex.join(bench_argv(self.vllm, self.model_name, server.port, run)))
            return
        with server:
            state = server.wait_healthy(self.profile.startup_timeout_s, self.health_poll_s)
            if state != "ok":
                raise HarnessError(
                    f"vllm serve ({arm}) did not become healthy ({state}); "
                    f"last lines of {server.log}:\n{server.log_tail()}"
                )
            since_start = scrape_spec_decode(server.url)
            for run, measured in runs:
                argv = bench_argv(self.vllm, self.model_name, server.port, run)
                sampler = NvmlSampler(self.nvml, self.sample_interval_s) if self.nvml else None
                if sampler:
                    sampler.start()
                try:
                    code = self._bench(argv)
                finally:
                    samples = sampler.stop() if sampler else []
                if code != 0:
                    raise HarnessError(f"vllm bench serve exited with {code}: {shlex.join(argv)}")
                if not measured:
                    continue
                bench = json.loads((run.result_dir / run.result_file).read_text())
                # `vllm bench serve` exits 0 even when every request failed.
                if bench.get("failed") or bench.get("completed") != run.prompts:
                    errors = [e for e in bench.get("errors", []) if e]
                    raise HarnessError(
                        f"vllm bench serve completed {bench.get('completed')} of {run.prompts} "
                        f"requests ({run.result_file}); first error:\n"
                        + (errors[0][-2000:] if errors else "none recorded")
                    )
                self._record(
                    run.result_file.removesuffix(".json").replace(
                        self.experiment, f"{self.experiment}-{self.profile.name}", 1
                    ),
                    f"replay-{self.experiment}",
                    {
                        "arm": arm,
                        "server_options": dataclasses.asdict(self.profile.options(arm)),
                        "input_len": run.input_len,
                        "output_len": run.output_len,
                        "run": run.run,
                        "bench_seed": run.seed,
                        "summary": summarize_bench(bench, run.output_len),
                        "bench": bench,
                        "nvml": {
                            "available": self.nvml is not None,
                            "note": self.nvml_note,
                            "interval_s": self.sample_interval_s,
                            "summary": summarize_samples(samples),
                            "by_phase": {
                                phase: summarize_samples(in_windows(samples, windows))
                                for phase, windows in phases(bench).items()
                            },
                            "samples": samples,
                        },
                        "server_log": str(server.log),
                    },
                    server,
                    argv,
                )
            until_stop = scrape_spec_decode(server.url)
            if since_start is not None and until_stop is not None:
                self._record(
                    f"{self.experiment}-{self.profile.name}-{arm}-spec-decode",
                    "replay-spec-decode",
                    {"arm": arm, "since_server_start": spec_decode_delta(since_start, until_stop)},
                    server,
                    None,
                )

    # -- oom

    def _oom(self, arm: str) -> None:
        server = self._server(arm)
        if self.dry_run:
            self.echo(shlex.join(server.argv))
            return
        sampler = NvmlSampler(self.nvml, self.sample_interval_s) if self.nvml else None
        started = time.monotonic()
        with server:
            if sampler:
                sampler.start()
            try:
                state = server.wait_healthy(self.profile.startup_timeout_s, self.health_poll_s)
            finally:
                samples = sampler.stop() if sampler else []
            elapsed = time.monotonic() - started
        text = server.log.read_text(errors="replace") if server.log.exists() else ""
        if state == "ok":
            outcome, message = "ok", ""
        elif state == "timeout":
            outcome, message = "error", f"not healthy after {self.profile.startup_timeout_s:.0f} s"
        else:
            outcome, message = classify_failure(text)
        last: dict[str, Any] = {}
        for row in samples:
            last[str(row["gpu"])] = row["mem_used_mib"]
        self._record(
            f"oom-{self.profile.name}-{arm}",
            "replay-oom",
            {
                "arm": arm,
                "server_options": dataclasses.asdict(self.profile.options(arm)),
                "outcome": outcome,
                "exception": message,
                "startup_s": round(elapsed, 1),
                "server_returncode": server.returncode,
                "memory_at_end_mib": last,
                "log_facts": log_facts(text),
                "log_tail": server.log_tail(60),
                "nvml": {
                    "available": self.nvml is not None,
                    "note": self.nvml_note,
                    "summary": summarize_samples(samples),
                },
                "server_log": str(server.log),
            },
            server,
            None,
        )


def summarize_bench(bench: Mapping[str, Any], output_len: int) -> dict[str, Any]:
    """The numbers the claims use, in seconds and tok/s, with their formulas."""
    lens = list(bench.get("output_lens") or [])
    tpot = bench.get("mean_tpot_ms")
    ttfts = [float(t) for t in bench.get("ttfts", []) if t]
    return {
        "ttft_s_mean": bench["mean_ttft_ms"] / 1000 if "mean_ttft_ms" in bench else None,
        "ttft_s_median": bench["median_ttft_ms"] / 1000 if "median_ttft_ms" in bench else None,
        "ttft_s": ttfts,
        "decode_tok_s": 1000 / tpot if tpot else None,
        "decode_tok_s_formula": "1000 / mean_tpot_ms = (n_out - 1) / (latency - ttft)",
        "completed": bench.get("completed"),
        "failed": bench.get("failed"),
        "output_lens": bench.get("output_lens"),
        # --ignore-eos must have held: every request produced exactly the output length.
        "output_lens_as_requested": bool(lens) and all(n == output_len for n in lens),
        "spec_decode_acceptance_rate_pct": bench.get("spec_decode_acceptance_rate"),
        "spec_decode_acceptance_length": bench.get("spec_decode_acceptance_length"),
        "spec_decode_per_position": bench.get("spec_decode_per_position_acceptance_rates"),
    }


# --- plot -----------------------------------------------------------------------------------------


def ttft_table(paths: Sequence[Path]) -> dict[str, dict[int, list[float]]]:
    """TTFT seconds per arm and input length, from replay-ttft result files."""
    table: dict[str, dict[int, list[float]]] = {}
    for path in paths:
        record = json.loads(path.read_text())
        if record.get("kind") != "replay-ttft":
            continue
        data = record["data"]
        per_len = table.setdefault(data["arm"], {})
        per_len.setdefault(int(data["input_len"]), []).extend(data["summary"]["ttft_s"])
    return table


def plot_ttft(paths: Sequence[Path], png: Path, title: str = "") -> Path:
    """Bar chart of TTFT by prefill mode (arm) and input length: mean bar, every run as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = ttft_table(paths)
    if not table:
        raise HarnessError("no replay-ttft results to plot")
    lens = sorted({n for per_len in table.values() for n in per_len})
    arms = list(table)
    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(2 + 2.2 * len(lens), 4))
    for i, arm in enumerate(arms):
        xs, means = [], []
        for j, n in enumerate(lens):
            values = table[arm].get(n, [])
            if not values:
                continue
            x = j + (i - (len(arms) - 1) / 2) * width
            xs.append(x)
            means.append(sum(values) / len(values))
            ax.scatter([x] * len(values), values, color="black", s=8, zorder=3)
        bars = ax.bar(xs, means, width, label=arm)
        ax.bar_label(bars, fmt="%.2f s", fontsize=7)
    ax.set_xticks(range(len(lens)), [f"{n:,} tokens" for n in lens])
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title or "TTFT by prefill mode")
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


# --- the command ----------------------------------------------------------------------------------


def default_out(project: Project, profile: str) -> Path:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return project.results / "replay" / f"{stamp}-{profile}"


def server_python(project: Project, python: Path | None, dry_run: bool) -> Path:
    """``python``, else the harness venv's with the built wheel installed (a name in a dry run)."""
    if python is not None:
        return python
    if dry_run:
        return Path("<harness venv>/bin/python")
    from harness import build, venv

    info = build.built(project)
    return venv.install_wheel(project, info.wheel, info.wheel_sha256)


def server_versions(python: Path) -> dict[str, str]:
    """vLLM, torch and CUDA versions of the interpreter that runs ``vllm serve``."""
    code = (
        "import importlib.metadata as m, json, torch;"
        "print(json.dumps({'vllm': m.version('vllm'), 'torch': torch.__version__,"
        "'cuda': str(torch.version.cuda)}))"
    )
    proc = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise HarnessError(f"{python} cannot import vllm/torch:\n{proc.stderr[-2000:]}")
    versions: dict[str, str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return versions


def server_provenance(
    python: Path, argv: Sequence[str], **extra: str
) -> Callable[[], dict[str, Any]]:
    """What each result of a served run records: :func:`harness.results.provenance` of
    ``python -m harness ARGV``, with the vLLM, torch and CUDA versions of ``python``, the
    interpreter that runs ``vllm serve`` (read once, here), and ``extra``."""
    versions = server_versions(python)

    def prov() -> dict[str, Any]:
        record = results.provenance(["python", "-m", "harness", *argv] if argv else None)
        record.update(torch=versions["torch"], cuda=versions["cuda"], vllm=versions["vllm"])
        record.update(extra)
        return record

    return prov


def main(
    project: Project,
    experiment: str,
    profile_name: str,
    *,
    out: Path | None = None,
    dry_run: bool = False,
    python: Path | None = None,
    vllm_command: Sequence[str] = (),
    port: int | None = None,
    argv: Sequence[str] = (),
) -> int:
    """``python -m harness replay``: see the module docstring.

    ``vllm_command`` runs vLLM's CLI (default: the ``vllm`` script beside ``python``).
    """
    if experiment == "plot":
        if out is None:
            raise HarnessError("replay plot needs --out DIR (a replay's result directory)")
        png = plot_ttft(sorted(out.glob("*.json")), out / "ttft.png", title=profile_name)
        print(png)
        return 0
    profiles = load_profiles()
    if profile_name not in profiles:
        raise HarnessError(f"unknown profile {profile_name!r}; known: {', '.join(profiles)}")
    profile = profiles[profile_name]
    out = out or default_out(project, profile_name)
    model: str | None = None
    if profile.server["model"] == SYNTHETIC:
        model = str(out / "checkpoint")
    python = server_python(project, python, dry_run)
    vllm = list(vllm_command) or [str(python.parent / "vllm")]
    runner = Runner(profile, experiment, out, vllm, model=model, dry_run=dry_run, port=port)
    if dry_run:
        if model:
            print(f"# python -m harness checkpoint {model}")
        runner.run()
        return 0
    nvml = load_nvml()
    other_python = os.path.abspath(sys.executable) != os.path.abspath(python)
    if nvml is None and other_python and argv and not os.environ.get("HARNESS_REPLAY_REEXEC"):
        progress(f"no NVML bindings here: re-running under {python}")
        return subprocess.call(
            [str(python), "-m", "harness", *argv],
            cwd=project.root,
            env={**os.environ, "HARNESS_REPLAY_REEXEC": "1"},
        )
    if model:
        from harness import checkpoint

        checkpoint.write(Path(model))
    runner.nvml = nvml
    runner.nvml_note = "" if nvml else "no NVML bindings importable: power/PCIe not sampled"
    runner.provenance = server_provenance(python, argv, server_python=str(python))
    written = runner.run()
    if experiment == "ttft" and written:
        try:
            print(plot_ttft(written, out / "ttft.png", title=profile_name))
        except ImportError:
            progress(f"no matplotlib here: `python -m harness replay plot --out {out}` draws it")
    for path in written:
        print(path)
    return 0
