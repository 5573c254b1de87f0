"""The end-to-end replay runner, against a fake `vllm` CLI (server and bench) and a fake NVML."""

from __future__ import annotations

import _thread
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import replay, results
from harness.project import REPO, HarnessError, Pin, Project

FAKE_VLLM = r'''
"""Stands in for the `vllm` CLI: `serve` (HTTP /health, /metrics and /v1/completions) and
`bench serve`. FAKE_VLLM_SOAK (comma-separated) changes what `serve` does for the soak:
bad-500 (a 500 for too many logprobs), pool-differs (other greedy texts with the pool),
ignore-sigterm, late-fault (a bad pool flag refused after weight loading). With FAKE_CGROUP
set (the soak's cgroup wrapper under a fake `unshare`) a pool flag is refused as the host
memory check refuses it under a small memory limit."""
import http.server, json, os, signal, subprocess, sys, time

mode = os.environ.get("FAKE_VLLM_MODE", "ok")
soak = os.environ.get("FAKE_VLLM_SOAK", "").split(",")
state = os.environ["FAKE_VLLM_DIR"]

def opt(name, default=None):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default

if sys.argv[1] == "serve":
    with open(os.path.join(state, "server.pid"), "w") as fh:
        fh.write(str(os.getpid()))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(os.path.join(state, "child.pid"), "w") as fh:
        fh.write(str(child.pid))
    if "ignore-sigterm" in soak:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rows, gb = opt("--moe-expert-pool-rows"), opt("--moe-expert-pool-gb")
    config = os.path.join(sys.argv[2], "config.json")
    config = json.load(open(config)) if os.path.exists(config) else {}
    fault = (  # as vLLM refuses them (top_k 4), before weight loading
        f"ValueError: --moe-expert-pool-rows={rows}: {sys.argv[2]} is not a "
        "mixture-of-experts model" if rows and config and "num_experts" not in config else
        f"ValueError: --moe-expert-pool-rows={rows}: {sys.argv[2]} is not quantized, and "
        "the expert pool holds NVFP4 experts" if rows and config
        and "quantization_config" not in config else
        f"ValueError: --moe-expert-pool-rows={rows}: the pooled experts need up to 35.4 GiB "
        "of pinned host memory (42 layer(s) from this one on, 0.84 GiB each), but 17.7 GiB "
        "of host memory are available" if rows and os.environ.get("FAKE_CGROUP") else
        f"ValueError: --moe-expert-pool-rows={rows}: the pool needs at least top_k=4 rows "
        "per layer" if rows and int(rows) < 4 else
        "ValueError: moe_expert_pool_rows and moe_expert_pool_gb are mutually exclusive"
        if rows and gb else None
    )
    if fault and "late-fault" not in soak:
        print(fault, flush=True)
        sys.exit(1)
    print("INFO Model loading took 21.94 GiB memory and 3.2 seconds", flush=True)
    if fault:
        print(fault, flush=True)
        sys.exit(1)
    if rows or gb:
        print(f"INFO Expert pool: 2 layers x 16 experts, {min(int(rows or 99), 15)} rows per "
              "layer", flush=True)
    if mode == "oom":
        print("(EngineCore pid=7) torch.OutOfMemoryError: CUDA out of memory. "
              "Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 31.36 GiB", flush=True)
        sys.exit(1)
    if mode == "crash":
        print("Traceback (most recent call last):\n  File \"x.py\", line 1", flush=True)
        print("(EngineCore pid=7) ValueError: bank too large: use --moe-expert-pool-rows <= 193",
              flush=True)
        sys.exit(1)
    print("INFO Available KV cache memory: 60.5 GiB", flush=True)
    scrapes = [0]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                self.send_response(503 if mode == "never-healthy" else 200)
                self.end_headers()
                return
            if self.path == "/metrics":
                scrapes[0] += 1
                n = scrapes[0]
                labels = 'engine="0",model_name="m"'
                sd = "vllm:spec_decode_num"
                per_pos = sd + "_accepted_tokens_per_pos_total"
                body = (
                    f"# HELP {sd}_drafts_total drafts\n"
                    f"{sd}_drafts_total{{{labels}}} {100 * n}\n"
                    f"{sd}_draft_tokens_total{{{labels}}} {300 * n}\n"
                    f"{sd}_accepted_tokens_total{{{labels}}} {184 * n}\n"
                    f'{per_pos}{{{labels},position="0"}} {83 * n}\n'
                    f'{per_pos}{{{labels},position="1"}} {60 * n}\n'
                    f'{per_pos}{{{labels},position="2"}} {41 * n}\n'
                    "vllm:num_requests_running 0\n"
                ).encode()
                if rows or gb:
                    body += (
                        f'vllm:moe_expert_pool_hits_total{{{labels},layer="0"}} {10 * n}\n'
                        f'vllm:moe_expert_pool_misses_total{{{labels},layer="0"}} {2 * n}\n'
                        f"vllm:moe_expert_pool_route_error{{{labels}}} 0\n"
                    ).encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(404)
            self.end_headers()

        def answer(self, code, payload):
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # /v1/completions, token-id prompts
            try:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            except ValueError:
                return self.answer(400, {"error": {"message": "malformed JSON"}})
            prompt, n = req.get("prompt") or [], req.get("max_tokens", 16)
            for code, message, bad in (
                (404, "no such model", req.get("model") != sys.argv[2]),
                (400, "empty prompt", not prompt),
                (400, "token id out of vocabulary", max(prompt or [0]) >= 512),
                (400, "max_tokens past the context", n > int(opt("--max-model-len", 1024))),
                (400, "n too large", req.get("n", 1) > 16384),
                (500 if "bad-500" in soak else 400, "logprobs too large",
                 (req.get("logprobs") or 0) > 20),
            ):
                if bad:
                    return self.answer(code, {"error": {"message": message}})
            base = 65 if "pool-differs" in soak and (rows or gb) else 97
            text = [chr(base + (sum(prompt) + i) % 26) for i in range(n)]
            if not req.get("stream"):
                return self.answer(200, {"choices": [{"text": "".join(text)}]})
            self.send_response(200)
            self.end_headers()
            try:
                for token in text:
                    time.sleep(0.002)
                    chunk = json.dumps({"choices": [{"text": token}]})
                    self.wfile.write(f"data: {chunk}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client dropped the stream

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", int(opt("--port"))), Handler).serve_forever()

elif sys.argv[1:3] == ["bench", "serve"]:
    with open(os.path.join(state, "bench.jsonl"), "a") as fh:
        fh.write(json.dumps(sys.argv[3:]) + "\n")
    if mode == "bench-fail":
        sys.exit(3)
    failed = mode == "bench-errors"  # what `vllm bench serve` does: exit 0 anyway
    if mode == "slow-bench":
        with open(os.path.join(state, "bench.pid"), "w") as fh:
            fh.write(str(os.getpid()))
        time.sleep(120)
    time.sleep(0.3)
    n_in, n_out = int(opt("--random-input-len")), int(opt("--random-output-len"))
    ttft_ms = n_in / 10.0
    result = {
        "backend": "openai", "completed": 0 if failed else int(opt("--num-prompts")),
        "failed": int(failed),
        "errors": ["Traceback: ConnectionRefusedError"] if failed else [""],
        "mean_ttft_ms": ttft_ms, "median_ttft_ms": ttft_ms, "p99_ttft_ms": ttft_ms,
        "mean_tpot_ms": 9.5, "median_tpot_ms": 9.5,
        # A step per streamed output, longer with more requests at once.
        "median_itl_ms": 9.0 * int(opt("--max-concurrency")),
        "p50_ttft_ms": ttft_ms, "p90_ttft_ms": ttft_ms, "p50_itl_ms": 9.0,
        "p90_itl_ms": 20.0, "p99_itl_ms": 30.0,
        "request_throughput": float(opt("--request-rate")) if opt("--request-rate") != "inf"
        else 1.0, "output_throughput": 100.0, "total_output_tokens": n_out,
        "ttfts": [ttft_ms / 1000], "output_lens": [n_out], "input_lens": [n_in],
        "start_times": [time.perf_counter() - 0.25], "latencies": [0.2],
        "spec_decode_acceptance_rate": 61.0, "spec_decode_acceptance_length": 2.84,
    }
    path = os.path.join(opt("--result-dir"), opt("--result-filename"))
    os.makedirs(opt("--result-dir"), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(result, fh)
else:
    sys.exit(f"fake vllm: unexpected {sys.argv[1:]}")
'''


class _Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FakeNvml:
    """Two GPUs; the second does not report PCIe throughput."""

    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        self.calls = 0

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self.calls += 1
        return 180_000 + 210_000 * h  # mW

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        if h == 1:
            raise self.NVMLError("not supported")
        return 52_000_000 if counter == self.NVML_PCIE_UTIL_RX_BYTES else 1_000

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Obj:
        return _Obj(used=(30 + h) * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> _Obj:
        return _Obj(gpu=90)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


TINY = replay.Profile(
    name="fake",
    description="",
    seed="test",
    server={"model": "org/model", "tensor_parallel_size": 1, "max_num_seqs": 1},
    arms={"a": {"max_num_batched_tokens": 512}, "b": {"max_num_batched_tokens": 1024}},
    experiments={
        "ttft": replay.ExperimentPlan(
            arms=("a", "b"), input_lens=(100, 300), output_len=4, runs=2, prompts=1, warmups=1
        ),
        "decode": replay.ExperimentPlan(arms=("a",), input_lens=(50,), output_len=16, runs=1),
        "oom": replay.ExperimentPlan(arms=("a",)),
    },
    startup_timeout_s=30,
    bench_timeout_s=30,
)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    state = tmp_path / "state"
    state.mkdir()
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    monkeypatch.setenv("FAKE_VLLM_DIR", str(state))
    monkeypatch.setenv("FAKE_VLLM_MODE", "ok")
    yield script
    for name in ("server.pid", "child.pid", "bench.pid"):
        pid_file = state / name
        if pid_file.exists():
            assert not _alive(int(pid_file.read_text())), f"{name} still running"


def _prov() -> dict[str, Any]:
    return {k: "test" for k in results.REQUIRED}


def _runner(fake: Path, out: Path, experiment: str, **kw: Any) -> replay.Runner:
    defaults: dict[str, Any] = dict(
        provenance=_prov, health_poll_s=0.1, stop_timeout_s=5, sample_interval_s=0.05
    )
    return replay.Runner(TINY, experiment, out, [sys.executable, str(fake)], **{**defaults, **kw})


def _server_stopped(fake_dir: Path) -> None:
    for name in ("server.pid", "child.pid"):
        pid = int((fake_dir / name).read_text())
        assert not _alive(pid), f"{name} {pid} is still running"


# --- profiles and commands ----------------------------------------------------------------------


def test_glm53_profile_gives_the_seed_command_lines() -> None:
    profile = replay.load_profiles()["glm53-tp2"]
    common = (
        "nvidia/GLM-5.3-Flash-NVFP4 --tensor-parallel-size 2 --moe-backend marlin "
        "--moe-expert-pool-rows {rows} --kv-cache-dtype fp8 --max-model-len 1048576 "
        "--max-num-seqs 4 --max-num-batched-tokens {mnbt}"
    )
    tail = (
        ' --compilation-config \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\' '
        "--speculative-config "
        '\'{"method": "mtp", "num_speculative_tokens": 3, "moe_backend": "triton"}\''
    )
    expected = {
        "host-view": common.format(rows=193, mnbt=4096)
        + " --no-moe-expert-pool-prefill-staging --disable-custom-all-reduce"
        + tail,
        "staging": common.format(rows=193, mnbt=8192) + " --disable-custom-all-reduce" + tail,
        "staging-car": common.format(rows=193, mnbt=9216) + tail,
        "bank240": common.format(rows=240, mnbt=8192) + " --disable-custom-all-reduce" + tail,
    }
    for arm, line in expected.items():
        assert shlex.join(profile.options(arm).argv()) == line, arm
    assert profile.plan("ttft").input_lens == (12500, 81600)
    assert profile.plan("ttft").arms == ("host-view", "staging", "staging-car")
    decode = profile.plan("decode")
    assert (decode.output_len, decode.runs) == (512, 3)


def test_b12x_profile_gives_the_design_note_commands() -> None:
    profile = replay.load_profiles()["b12x-qwen36"]
    assert shlex.join(profile.options("dp2").argv()) == (
        "nvidia/Qwen3.6-35B-A3B-NVFP4 --data-parallel-size 2 --moe-backend flashinfer_b12x "
        "--kv-cache-dtype fp8 --max-model-len 32768 --max-num-batched-tokens 8192 "
        "--gpu-memory-utilization 0.92"
    )
    assert profile.options("kv-marlin").argv()[-1] == "--trust-remote-code"
    assert "--moe-backend marlin" in shlex.join(profile.options("kv-marlin").argv())


def test_tiny_profile_runs_triton_attention_and_the_pool_arm() -> None:
    profile = replay.load_profiles()["tiny-synthetic"]
    head = "CKPT --tensor-parallel-size 1 --moe-backend marlin --attention-backend TRITON_ATTN"
    tail = (
        " --max-model-len 8192 --max-num-seqs 4 --max-num-batched-tokens 2048"
        " --gpu-memory-utilization 0.3"
        ' --compilation-config \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\''
    )
    assert shlex.join(profile.options("default").argv("CKPT")) == head + tail
    assert shlex.join(profile.options("pool").argv("CKPT")) == (
        head + " --moe-expert-pool-rows 4" + tail
    )
    assert profile.plan("ttft").arms == ("default", "pool")


def test_every_profile_loads_and_names_existing_arms() -> None:
    profiles = replay.load_profiles()
    assert {"glm53-tp2", "b12x-qwen36", "tiny-synthetic"} <= set(profiles)
    assert profiles["tiny-synthetic"].server["model"] == replay.SYNTHETIC


def test_unknown_options_and_arms_are_errors(tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text(
        '[x.server]\nmodel = "m"\n[x.arms.a]\nmax_num_seq = 4\n[x.experiments.oom]\narms = ["a"]\n'
    )
    with pytest.raises(HarnessError, match="max_num_seq"):
        replay.load_profiles(bad)
    bad.write_text('[x.server]\nmodel = "m"\n[x.experiments.oom]\narms = ["nope"]\n')
    with pytest.raises(HarnessError, match="no arm 'nope'"):
        replay.load_profiles(bad)


def test_bench_argv_is_exact(tmp_path: Path) -> None:
    run = replay.BenchRun(12500, 16, 1, 2, tmp_path, "r.json", {"arm": "a"})
    assert replay.bench_argv(["vllm"], "org/m", 9000, run) == [
        "vllm",
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        "http://127.0.0.1:9000",
        "--endpoint",
        "/v1/completions",
        "--model",
        "org/m",
        "--tokenizer",
        "org/m",
        "--dataset-name",
        "random",
        "--random-input-len",
        "12500",
        "--random-output-len",
        "16",
        "--random-range-ratio",
        "0",
        "--random-prefix-len",
        "0",
        "--num-prompts",
        "1",
        "--max-concurrency",
        "1",
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-warmups",
        "0",
        "--seed",
        "2",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "r.json",
        "--metadata",
        "arm=a",
    ]


def test_dry_run_prints_every_command_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert replay.main(Project.discover(), "ttft", "glm53-tp2", out=out, dry_run=True) == 0
    lines = capsys.readouterr().out.splitlines()
    serves = [ln for ln in lines if " serve nvidia/" in ln]
    benches = [ln for ln in lines if " bench serve " in ln]
    assert len(serves) == 3 and len(benches) == 3 * 2 * (1 + 3)
    assert serves[0].startswith("'<harness venv>/bin/vllm' serve nvidia/GLM-5.3-Flash-NVFP4 ")
    assert serves[0].endswith("--host 127.0.0.1 --port 8000")
    assert "--no-moe-expert-pool-prefill-staging" in serves[0]
    assert "--no-moe-expert-pool-prefill-staging" not in serves[1]
    assert not out.exists()


def test_vllm_command_runs_serve_and_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.__main__ import main

    cli = "python3 -m vllm.entrypoints.cli.main"
    argv = ["replay", "ttft", "--profile", "tiny-synthetic", "--dry-run", "--out", str(tmp_path)]
    assert main([*argv, "--vllm-command", cli]) == 0
    commands = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    serves = [ln for ln in commands if ln.startswith(f"{cli} serve ")]
    benches = [ln for ln in commands if ln.startswith(f"{cli} bench serve ")]
    assert len(serves) == 2 and len(benches) == 2 * 2 * (1 + 2)
    assert len(commands) == len(serves) + len(benches)


def test_python_of_a_venv_is_not_resolved_out_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.__main__ import main

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(sys.executable)  # as `python -m venv` makes it
    argv = ["replay", "oom", "--profile", "tiny-synthetic", "--dry-run", "--out", str(tmp_path)]
    assert main([*argv, "--python", str(python)]) == 0
    serve = capsys.readouterr().out.splitlines()[-1]
    assert serve.startswith(f"{python.parent / 'vllm'} serve ")


def test_dry_run_of_the_tiny_profile_names_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replay.main(Project.discover(), "oom", "tiny-synthetic", out=tmp_path, dry_run=True)
    text = capsys.readouterr().out
    assert f"# python -m harness checkpoint {tmp_path / 'checkpoint'}" in text
    assert f"serve {tmp_path / 'checkpoint'} --tensor-parallel-size 1 --moe-backend marlin" in text


# --- the runner against the fake server ---------------------------------------------------------


def test_ttft_run_writes_valid_results_and_stops_the_server(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    out = tmp_path / "out"
    runner = _runner(
        fake, out, "ttft", nvml=FakeNvml(), provenance=results.provenance, sample_interval_s=0.002
    )
    written = runner.run()
    names = sorted(p.name for p in written)
    assert names == sorted(
        [f"ttft-fake-{a}-in{n}-run{r}.json" for a in "ab" for n in (100, 300) for r in (1, 2)]
        + ["ttft-fake-a-spec-decode.json", "ttft-fake-b-spec-decode.json"]
    )
    assert all(results.validate(p) == [] for p in written)
    _server_stopped(Path(os.environ["FAKE_VLLM_DIR"]))
    record = json.loads((out / "ttft-fake-b-in300-run2.json").read_text())
    data, prov = record["data"], record["provenance"]
    assert record["kind"] == "replay-ttft"
    assert data["arm"] == "b" and data["input_len"] == 300 and data["run"] == 2
    assert data["summary"]["ttft_s"] == [0.03] and data["summary"]["ttft_s_mean"] == 0.03
    assert data["summary"]["decode_tok_s"] == pytest.approx(1000 / 9.5)
    assert data["summary"]["output_lens_as_requested"] is True
    assert prov["server_argv"][2:] == [
        "serve",
        "org/model",
        "--tensor-parallel-size",
        "1",
        "--max-num-seqs",
        "1",
        "--max-num-batched-tokens",
        "1024",
        "--host",
        "127.0.0.1",
        "--port",
        prov["server_argv"][-1],
    ]
    assert prov["bench_argv"][2:4] == ["bench", "serve"]
    assert prov["bench_argv"][prov["bench_argv"].index("--seed") + 1] == "6"
    assert data["bench_seed"] == 6
    # real provenance from patches/base.toml
    assert prov["base"]["version"] == Pin.load(REPO / "patches" / "base.toml").default.version
    assert prov["env"]["TORCH_COMPILE_DISABLE"] == "1"  # inherited switches are recorded
    assert "PATH" not in prov["env"] and "HOME" not in prov["env"]
    nvml = data["nvml"]
    assert nvml["available"] and nvml["samples"]
    assert nvml["summary"]["0"]["power_w_mean"] == 180.0
    assert nvml["summary"]["1"]["power_w_max"] == 390.0
    assert nvml["summary"]["0"]["pcie_rx_kb_s_mean"] == 52_000_000
    assert nvml["summary"]["1"]["pcie_rx_kb_s_mean"] is None
    # The fake requests' prefills (10 or 30 ms) and decodes (170-190 ms) ran while NVML was
    # sampled every 2 ms, on the bench's clock: a loaded host may leave a window without a
    # sample, but not every window of the eight runs (with another clock, none has one).
    by_phase = [
        json.loads(path.read_text())["data"]["nvml"]["by_phase"]
        for path in out.glob("ttft-fake-*-run*.json")
    ]
    assert len(by_phase) == 8
    for phase in ("prefill", "decode"):
        sampled = [windows[phase]["0"] for windows in by_phase if "0" in windows[phase]]
        assert sampled and {gpu["power_w_mean"] for gpu in sampled} == {180.0}, phase
    # Warm-ups are their own bench runs with other seeds, never measured.
    benches = [
        json.loads(ln)
        for ln in (Path(os.environ["FAKE_VLLM_DIR"]) / "bench.jsonl").read_text().splitlines()
    ]
    seeds = [b[b.index("--seed") + 1] for b in benches]
    assert len(benches) == 2 * 2 * 3 and seeds[:6] == ["1", "2", "3", "4", "5", "6"]
    assert seeds[6:] == seeds[:6]  # arm b: a new server, a fresh prefix cache
    assert [b[b.index("--random-input-len") + 1] for b in benches[:6]] == ["100"] * 3 + ["300"] * 3
    assert all(b[b.index("--num-warmups") + 1] == "0" for b in benches)
    spec = json.loads((out / "ttft-fake-a-spec-decode.json").read_text())["data"]
    since = spec["since_server_start"]
    assert since["acceptance_rate"] == pytest.approx(184 / 300)
    assert since["tokens_per_step"] == pytest.approx(2.84)
    assert since["per_position_acceptance"] == pytest.approx([0.83, 0.60, 0.41])


def test_bench_failure_stops_the_server(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "bench-fail")
    with pytest.raises(HarnessError, match="exited with 3"):
        _runner(fake, tmp_path, "decode").run()
    _server_stopped(Path(os.environ["FAKE_VLLM_DIR"]))


def test_failed_requests_are_an_error_and_stop_the_server(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "bench-errors")
    with pytest.raises(HarnessError, match=r"completed 0 of 1 [\s\S]*ConnectionRefusedError"):
        _runner(fake, tmp_path, "decode").run()
    _server_stopped(Path(os.environ["FAKE_VLLM_DIR"]))


def test_health_timeout_stops_the_server(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "never-healthy")
    profile = replay.Profile(**{**TINY.__dict__, "startup_timeout_s": 1.5})
    runner = replay.Runner(
        profile,
        "decode",
        tmp_path,
        [sys.executable, str(fake)],
        provenance=_prov,
        health_poll_s=0.1,
        stop_timeout_s=5,
    )
    started = time.monotonic()
    with pytest.raises(HarnessError, match=r"did not become healthy \(timeout\)"):
        runner.run()
    assert time.monotonic() - started < 20
    _server_stopped(Path(os.environ["FAKE_VLLM_DIR"]))


def test_ctrl_c_during_bench_stops_bench_and_server(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "slow-bench")
    state = Path(os.environ["FAKE_VLLM_DIR"])

    def interrupt_when_bench_runs() -> None:
        deadline = time.monotonic() + 120  # the server's start and the bench's, when loaded
        while not (state / "bench.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_bench_runs, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        _runner(fake, tmp_path, "decode").run()
    _server_stopped(state)
    assert not _alive(int((state / "bench.pid").read_text()))


def test_keyboard_interrupt_anywhere_stops_the_server(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(self: replay.Runner, argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(replay.Runner, "_bench", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _runner(fake, tmp_path, "ttft").run()
    _server_stopped(Path(os.environ["FAKE_VLLM_DIR"]))


@pytest.mark.parametrize(
    ("mode", "outcome", "text"),
    [
        ("ok", "ok", ""),
        ("oom", "oom", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("crash", "error", "ValueError: bank too large: use --moe-expert-pool-rows <= 193"),
        ("never-healthy", "error", "not healthy after 2 s"),
    ],
)
def test_oom_experiment_records_the_outcome(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, outcome: str, text: str
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", mode)
    # A server that gets healthy or exits ends the wait, so a long limit costs nothing and
    # lets a loaded host start it; only the server that never gets healthy waits it out.
    timeout_s = 2 if mode == "never-healthy" else 120
    profile = replay.Profile(**{**TINY.__dict__, "startup_timeout_s": timeout_s})
    runner = replay.Runner(
        profile,
        "oom",
        tmp_path,
        [sys.executable, str(fake)],
        provenance=_prov,
        health_poll_s=0.1,
        stop_timeout_s=5,
        nvml=FakeNvml(),
        sample_interval_s=0.05,
    )
    (path,) = runner.run()
    assert results.validate(path) == []
    data = json.loads(path.read_text())["data"]
    assert data["outcome"] == outcome
    assert data["exception"].startswith(text)
    assert data["log_facts"]["model_loading_gib"] == [21.94]
    assert data["memory_at_end_mib"] == {"0": 30 * 1024.0, "1": 31 * 1024.0}
    if mode == "ok":
        assert data["log_facts"]["available_kv_cache_gib"] == [60.5]
    _server_stopped(Path(os.environ["FAKE_VLLM_DIR"]))


# --- NVML, parsing, plot ------------------------------------------------------------------------


def test_nvml_sampler_samples_in_the_background() -> None:
    clock = iter(range(10_000))
    nvml = FakeNvml()
    sampler = replay.NvmlSampler(nvml, interval_s=0.01, clock=lambda: float(next(clock)))
    sampler.start()
    deadline = time.monotonic() + 60  # the wait ends at the sixth sample
    while len(sampler.samples) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = sampler.stop()
    count = len(samples)
    time.sleep(0.05)
    assert len(sampler.samples) == count >= 6  # stopped: no more samples
    assert {s["gpu"] for s in samples} == {0, 1}
    first = samples[0]
    assert first == {
        "t": 0.0,
        "gpu": 0,
        "power_w": 180.0,
        "pcie_tx_kb_s": 1000,
        "pcie_rx_kb_s": 52_000_000,
        "mem_used_mib": 30 * 1024.0,
        "util_pct": 90,
    }
    assert samples[1]["pcie_tx_kb_s"] is None and samples[1]["power_w"] == 390.0
    summary = replay.summarize_samples(samples)
    assert summary["1"]["samples"] == count // 2 and summary["1"]["pcie_tx_kb_s_mean"] is None


def test_phases_split_samples_by_request_windows() -> None:
    bench = {"start_times": [10.0, 20.0], "ttfts": [1.5, 2.0], "latencies": [4.0, 2.0]}
    windows = replay.phases(bench)
    assert windows == {"prefill": [(10.0, 11.5), (20.0, 22.0)], "decode": [(11.5, 14.0)]}
    samples = [{"t": t, "gpu": 0, "power_w": float(t)} for t in (9.0, 10.5, 12.0, 21.0, 30.0)]
    assert [s["t"] for s in replay.in_windows(samples, windows["prefill"])] == [10.5, 21.0]
    assert (
        replay.summarize_samples(replay.in_windows(samples, windows["decode"]))["0"]["power_w_mean"]
        == 12.0
    )


def test_server_env_keeps_only_switches_that_change_a_server() -> None:
    environ = {"PATH": "/bin", "VLLM_USE_V2_MODEL_RUNNER": "0", "HF_HUB_OFFLINE": "1", "X": "y"}
    assert replay.server_env(environ) == {"HF_HUB_OFFLINE": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}


def test_load_nvml_returns_none_without_bindings(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise ImportError(name)

    monkeypatch.setattr(replay.importlib, "import_module", missing)
    assert replay.load_nvml() is None


def test_failure_classification() -> None:
    log = (
        "INFO start\nTraceback\n(EngineCore_DP0 pid=1) RuntimeError: CUDA error: "
        "an illegal memory access was encountered\nINFO shutdown\n"
    )
    assert replay.classify_failure(log) == (
        "error",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
    )
    assert (
        replay.classify_failure("x\ntorch.OutOfMemoryError: CUDA out of memory. Tried\n")[0]
        == "oom"
    )
    assert replay.classify_failure("") == ("error", "no output")
    facts = replay.log_facts(
        "GPU KV cache size: 1,800,000 tokens\nAvailable KV cache memory: 3.5 GiB\n"
    )
    assert facts["gpu_kv_cache_tokens"] == [1_800_000.0] and facts["available_kv_cache_gib"] == [
        3.5
    ]


def _ttft_result(dir: Path, arm: str, n: int, run: int, ttft: float) -> Path:
    data = {"arm": arm, "input_len": n, "run": run, "summary": {"ttft_s": [ttft]}}
    return results.write(dir / f"{arm}-{n}-{run}.json", "replay-ttft", data, _prov())


def test_ttft_plot_from_replay_results(tmp_path: Path) -> None:
    paths = [
        _ttft_result(tmp_path, arm, n, r, base * n / 12500 + r / 100)
        for arm, base in (("host-view", 9.6), ("staging", 1.8))
        for n in (12500, 81600)
        for r in (1, 2, 3)
    ]
    paths.append(results.write(tmp_path / "other.json", "replay-oom", {}, _prov()))
    table = replay.ttft_table(paths)
    assert set(table) == {"host-view", "staging"}
    assert table["staging"][12500] == pytest.approx([1.81, 1.82, 1.83])
    png = replay.plot_ttft(paths, tmp_path / "plots" / "ttft.png", title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    with pytest.raises(HarnessError, match="no replay-ttft"):
        replay.plot_ttft(paths[-1:], tmp_path / "none.png")


def test_cli_wiring(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from harness.__main__ import main

    assert (
        main(["replay", "decode", "--profile", "glm53-tp2", "--dry-run", "--out", str(tmp_path)])
        == 0
    )
    assert "--random-output-len 512" in capsys.readouterr().out
    assert main(["checkpoint", str(tmp_path / "ck"), "--layers", "1", "--experts", "2"]) == 0
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["num_experts"] == 2
    assert main(["checkpoint", str(tmp_path / "bad"), "--hidden-size", "100"]) == 2
