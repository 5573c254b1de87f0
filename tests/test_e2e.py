"""The end-to-end comparison: the routed checkpoint, the budget each arm gets, the summary.

numpy is needed for the checkpoint writer (the nox session installs it); the
tests skip, with that reason, where it is missing.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from test_replay import fake  # noqa: F401 (the fake `vllm` CLI fixture)

from harness import checkpoint, checkpoint_routed, document, e2e
from harness.checkpoint import Spec
from harness.checkpoint_routed import ROUTERS

np = pytest.importorskip("numpy", reason="the routed checkpoint writer needs numpy")

SMALL = Spec(
    layers=2, experts=16, top_k=4, hidden_size=512, moe_intermediate_size=256,
    num_attention_heads=4, num_key_value_heads=2, head_dim=128, shard_bytes=1 << 20,
)  # fmt: skip


def test_routed_checkpoint_shares_every_tensor_but_the_routers(tmp_path: Path) -> None:
    folders = checkpoint_routed.write(tmp_path, SMALL, workers=2, echo=lambda _: None)
    maps = {}
    for router, folder in folders.items():
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        maps[router] = index
        for file in set(index.values()):
            names = set(checkpoint.read_safetensors_header(folder / file))
            assert names == {n for n, f in index.items() if f == file}
    # The same tensor names, the same files except the router shard, and hard links.
    assert maps["uniform"].keys() == maps["skewed"].keys()
    differ = {n for n in maps["uniform"] if maps["uniform"][n] != maps["skewed"][n]}
    assert differ == {f"model.layers.{i}.mlp.gate.weight" for i in range(SMALL.layers)}
    shared = sorted((tmp_path / "shared").glob("*.safetensors"))
    assert shared and all(p.stat().st_nlink == 3 for p in shared)
    config = json.loads((folders["skewed"] / "config.json").read_text())
    assert config["num_experts"] == 16 and config["quantization_config"]["quant_algo"] == "NVFP4"


def test_routed_checkpoint_is_reused_only_when_current(tmp_path: Path) -> None:
    said: list[str] = []
    checkpoint_routed.write(tmp_path, SMALL, ("skewed",), workers=1, echo=said.append)
    shard = sorted((tmp_path / "shared").glob("*.safetensors"))[0]
    before = shard.read_bytes()
    checkpoint_routed.write(tmp_path, SMALL, ("skewed",), workers=1, echo=said.append)
    assert "not rewritten" in said[-1]
    other = dataclasses.replace(SMALL, seed=1)
    checkpoint_routed.write(tmp_path, other, ("skewed",), workers=1, echo=said.append)
    assert "not rewritten" not in said[-1] and shard.read_bytes() != before
    for variant in ({"dense": True}, {"weights": "bf16"}):
        with pytest.raises(ValueError, match="NVFP4 MoE checkpoints only"):
            checkpoint_routed.write(tmp_path, dataclasses.replace(SMALL, **variant), ("skewed",))


def test_a_router_is_added_beside_the_shared_shards_without_rewriting_them(
    tmp_path: Path,
) -> None:
    # Session 7's first GPU call: the second server asked for the uniform router of a
    # checkpoint written with skewed only, and the writer tried to rewrite 37 GiB.
    said: list[str] = []
    checkpoint_routed.write(tmp_path, SMALL, ("skewed",), workers=1, echo=said.append)
    shards = sorted((tmp_path / "shared").glob("*.safetensors"))
    inodes = [p.stat().st_ino for p in shards]
    folders = checkpoint_routed.write(tmp_path, SMALL, ("uniform",), workers=1, echo=said.append)
    assert any("shared shards current; adding routers uniform" in line for line in said)
    assert [p.stat().st_ino for p in shards] == inodes
    assert all(p.stat().st_nlink == 3 for p in shards)
    fresh = checkpoint_routed.write(tmp_path / "fresh", SMALL, ("uniform",), workers=1, echo=print)
    for file in sorted(p.name for p in fresh["uniform"].glob("*")):
        assert (folders["uniform"] / file).read_bytes() == (fresh["uniform"] / file).read_bytes()
    checkpoint_routed.write(tmp_path, SMALL, ROUTERS, workers=1, echo=said.append)
    assert "not rewritten" in said[-1]


def test_another_spec_unlinks_the_router_folders_before_counting_free_space(
    tmp_path: Path,
) -> None:
    checkpoint_routed.write(tmp_path, SMALL, ROUTERS, workers=1, echo=print)
    other = dataclasses.replace(SMALL, seed=1)
    checkpoint_routed.write(tmp_path, other, ("skewed",), workers=1, echo=print)
    assert not list((tmp_path / "uniform").glob("*.safetensors"))
    assert all(p.stat().st_nlink == 2 for p in (tmp_path / "shared").glob("*.safetensors"))


def test_a_checkpoint_that_does_not_fit_the_disk_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=1 << 20))
    with pytest.raises(ValueError, match=r"needs 1\.0 GiB and .* has 0\.0 GiB free: write it"):
        checkpoint_routed.write(tmp_path, SMALL, workers=1, echo=print)
    assert not list((tmp_path / "shared").glob("*.safetensors"))


def test_bytes_do_not_depend_on_the_worker_count(tmp_path: Path) -> None:
    a = checkpoint_routed.write(tmp_path / "a", SMALL, ("uniform",), workers=1, echo=print)
    b = checkpoint_routed.write(tmp_path / "b", SMALL, ("uniform",), workers=3, echo=print)
    for file in sorted(p.name for p in a["uniform"].glob("*.safetensors")):
        assert (a["uniform"] / file).read_bytes() == (b["uniform"] / file).read_bytes()


def test_skewed_router_follows_its_popularity_and_uniform_does_not() -> None:
    spec = dataclasses.replace(checkpoint_routed.GLM_SHAPE, layers=2)
    skewed = checkpoint_routed.routing_check(spec, "skewed", tokens=2048)
    uniform = checkpoint_routed.routing_check(spec, "uniform", tokens=2048)
    for layer in skewed["layers"]:
        # Zipf s=1 over 128 experts, top-8: about 40% of choices on the 8 hottest experts.
        assert abs(layer["hot_share_observed"] - layer["hot_share_ideal"]) < 0.03
        assert layer["hot_share_ideal"] > 0.35
    for layer in uniform["layers"]:
        assert abs(layer["hot_share_observed"] - 8 / 128) < 0.015
        assert layer["distinct_experts"] == 128


def test_expert_and_other_bytes_match_the_written_files(tmp_path: Path) -> None:
    folder = checkpoint_routed.write(tmp_path, SMALL, ("skewed",), workers=1, echo=print)["skewed"]
    experts = other = 0
    for file in folder.glob("*.safetensors"):
        for name, entry in checkpoint.read_safetensors_header(file).items():
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            if ".mlp.experts." in name and not name.endswith(("_scale_2", "input_scale")):
                experts += size
            else:
                other += size
    assert checkpoint_routed.expert_bytes(SMALL) == experts
    # The expert scalars (two per linear) are counted with the other bytes' 8-byte allowance.
    scalars = SMALL.layers * SMALL.experts * 3 * 8
    assert checkpoint_routed.other_bytes(SMALL) == other - scalars


def test_prefetch_layout_nearest_the_budget_in_the_alternatives_favour() -> None:
    # 42 layers at 25%: 10.5 resident is the target; 11 (group 4, 3 offloaded) beats 10.
    assert e2e.prefetch_layout(42, 0.25) == (4, 3, 11)
    assert e2e.prefetch_layout(8, 0.25) == (4, 3, 2)
    assert e2e.prefetch_layout(10, 0.5) == (2, 1, 5)


def test_each_arm_gets_the_budget_in_its_own_units() -> None:
    profile = e2e.load_profiles()["glm-shape-h200"]
    spec = profile.checkpoint_spec()
    total_gib = checkpoint_routed.expert_bytes(spec) / 2**30
    # The pool by GiB: the 8.86 GiB budget, which the series' -gb spends on the bank,
    # its staging rows and the prefill staging buffers together.
    pool = e2e.server_options(profile, profile.arms["pool"], spec, speculative=False)
    argv = pool.argv()
    assert argv[argv.index("--moe-expert-pool-gb") + 1] == "8.859"
    assert "--moe-expert-pool-rows" not in argv
    assert e2e.offload_options(profile.arms["pool"], spec, 0.25)["moe_expert_pool_gb"] == 8.859
    host_view = e2e.offload_options(profile.arms["pool-host-view"], spec, 0.25)
    assert host_view["fields"] == {"moe_expert_pool_gb": 8.859, "prefill_staging": False}
    uva = e2e.server_options(profile, profile.arms["uva"], spec, speculative=False)
    gb = float(uva.extra_args[uva.extra_args.index("--cpu-offload-gb") + 1])
    assert abs(gb - 0.75 * total_gib) < 0.01 and "experts" in uva.extra_args
    prefetch = e2e.server_options(profile, profile.arms["prefetch"], spec, speculative=True)
    argv = prefetch.argv()
    assert argv[argv.index("--offload-group-size") + 1] == "4"
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "ngram"
    host_view = e2e.server_options(profile, profile.arms["pool-host-view"], spec, False)
    assert "--no-moe-expert-pool-prefill-staging" in host_view.argv()
    # The pool arm takes the series' default admission, pool-frequency asks for frequency.
    assert "--moe-expert-pool-admission" not in pool.argv()
    frequency = e2e.server_options(profile, profile.arms["pool-frequency"], spec, False)
    argv = frequency.argv()
    assert argv[argv.index("--moe-expert-pool-admission") + 1] == "frequency"
    assert argv[argv.index("--moe-expert-pool-gb") + 1] == "8.859"


def _server(arm: str, offload: str, loading: float, **facts: list[float]) -> dict[str, object]:
    return {
        "arm": arm, "offload": offload, "router": "skewed", "speculative": None,
        "budget": {"fraction": 0.25}, "outcome": "runs", "startup_s": 1.0,
        "facts": {"model_loading_gib": [loading], **facts},
        "checkpoint": dataclasses.asdict(checkpoint_routed.GLM_SHAPE),
    }  # fmt: skip


def _write_record(
    folder: Path, name: str, kind: str, data: Mapping[str, Any], server_argv: Sequence[str] = ()
) -> None:
    """``folder/name.json``: an e2e result record of ``kind`` with a made-up provenance."""
    prov: dict[str, Any] = dict.fromkeys(
        ("command", "date", "host", "gpu", "driver", "cuda", "torch", "python"), "x"
    )
    prov.update(base={}, server_argv=list(server_argv))
    record = {"schema": 1, "kind": kind, "provenance": prov, "data": data}
    (folder / f"{name}.json").write_text(json.dumps(record))


def test_summary_tells_an_arm_that_holds_the_budget_from_one_that_does_not(
    tmp_path: Path,
) -> None:
    # As measured on the H200: the pool's bank of 32 rows x 42 layers + 64 step rows and
    # two 0.84 GiB prefill buffers (11.0 GiB of experts on the GPU, 24% over the budget:
    # the staging counts); UVA on 0.34.0 kept 8.84 GiB.
    records = {
        "server-pool": _server("pool", "pool", 11.9, pool_bank_gib=[9.28],
                               pool_rows_per_layer=[32], pool_staging_buffers=[2],
                               pool_staging_buffer_gib=[0.84]),
        "server-uva": _server("uva", "uva", 9.72, uva_offloaded_gib=[26.66]),
    }  # fmt: skip
    for name, data in records.items():
        _write_record(tmp_path, name, "e2e-server", data)
    decode = {**records["server-pool"], "concurrency": 32, "output_len": 256,
              "outcome": "ok", "summary": {"decode_tok_s": 93.9},
              "pool_metrics": {"hit_rate": 0.8}}  # fmt: skip
    _write_record(tmp_path, "decode", "e2e-decode", decode)
    summary = e2e.summarize(tmp_path)
    holds = {s["arm"]: s["holds_budget"] for s in summary["servers"]}
    assert holds == {"pool": False, "uva": True}
    assert summary["decode"] == [{
        "arm": "pool", "router": "skewed", "outcome": "ok", "concurrency": 32,
        "spec_tokens": 0, "output_len": 256, "temperature": 0.0, "tok_s": 93.9,
        "acceptance_rate": None,
        "pool_hit_rate": None, "pool_metrics_hit_rate": 0.8, "pool_mib_per_step": None,
        # The backend of the server the bench measured (here one from before servers
        # recorded it, started without --attention-backend).
        "attention_backend": "default (not logged)",
    }]  # fmt: skip
    assert summary["budget_gib"] == pytest.approx(0.25 * 35.44, abs=0.01)


def test_pool_counters_sum_the_windows_a_bench_logged() -> None:
    spec = checkpoint_routed.PRESETS["glm-shape"]
    row = checkpoint_routed.expert_bytes(spec) / (spec.layers * spec.experts)
    log = "\n".join([
        "INFO 12-01 [stats.py:190] Expert pool: hit rate 90.0% (lowest layer 50.0%), 90 hits,"
        " 10 misses, 8 promotions, 0.06 GiB copied in the last 0.5 s; lifetime hit rate 1.0%.",
        "INFO 12-01 [loggers.py:1] Engine 000: Avg prompt throughput: 0.0 tokens/s",
        "INFO 12-01 [stats.py:190] Expert pool: hit rate 75.0% (lowest layer 0.0%), 30 hits,"
        " 10 misses, 10 promotions, 0.06 GiB copied in the last 0.4 s; lifetime hit rate 2.0%; "
        "0.00 GiB staged for 0 prefill steps.",
    ])  # fmt: skip
    got = e2e.pool_counters(log, spec, output_tokens=256, steps=128)
    assert got is not None
    assert (got["windows"], got["hits"], got["misses"], got["promotions"]) == (2, 120, 20, 18)
    assert got["hit_rate"] == round(120 / 140, 4) and got["window_s"] == 0.9
    assert got["mib_per_step"] == round(20 * row / 2**20 / 128, 2)
    assert got["mib_per_output_token"] == round(20 * row / 2**20 / 256, 2)
    assert got["experts_per_layer_step"] == round(140 / (spec.layers * 128), 2)
    assert e2e.pool_counters(log, spec, 256, steps=None)["mib_per_step"] is None
    assert e2e.pool_counters("no pool here", spec, 256, 128) is None


def test_pool_metrics_is_the_scraped_delta_summed_over_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def page(hits: tuple[int, int], misses: int, error: int) -> str:
        lines = [
            "# HELP vllm:moe_expert_pool_hits Hits.",
            "# TYPE vllm:moe_expert_pool_hits counter",
        ]
        for layer, n in enumerate(hits):
            lines.append(f'vllm:moe_expert_pool_hits_total{{engine="0",layer="{layer}"}} {n}.0')
            lines.append(f'vllm:moe_expert_pool_hits_created{{engine="0",layer="{layer}"}} 1.7e9')
        lines += [
            f'vllm:moe_expert_pool_misses_total{{engine="0",layer="0"}} {misses}.0',
            'vllm:moe_expert_pool_promotions_total{engine="0",layer="0"} 2.0',
            'vllm:moe_expert_pool_copied_bytes_total{engine="0",layer="0"} 4096.0',
            f'vllm:moe_expert_pool_route_error{{engine="0"}} {error}.0',
            'vllm:spec_decode_num_drafts_total{engine="0"} 7.0',
        ]
        return "\n".join(lines)

    pages = iter([page((10, 5), 5, 0), page((40, 15), 15, 1)])
    monkeypatch.setattr(e2e.replay, "http_get", lambda url: (200, next(pages)))
    before = e2e.replay.scrape_metrics("http://x", e2e.POOL_METRICS)
    after = e2e.replay.scrape_metrics("http://x", e2e.POOL_METRICS)
    assert before is not None and not any("spec_decode" in k for k in before)
    got = e2e.pool_metrics(before, after)
    assert got is not None
    assert (got["hits"], got["misses"], got["promotions"], got["copied_bytes"]) == (40, 10, 0, 0)
    assert got["hit_rate"] == 0.8 and got["route_error"] == 1.0 and got["layers"] == 2
    assert e2e.pool_metrics(before, None) is None
    # The summed form (one series, no layer label): the same counts, no layer count.
    summed = {'vllm:moe_expert_pool_hits_total{engine="0"}': 55.0,
              'vllm:moe_expert_pool_misses_total{engine="0"}': 15.0}  # fmt: skip
    got = e2e.pool_metrics({}, summed)
    assert got is not None and got["layers"] is None
    assert (got["hits"], got["misses"], got["hit_rate"]) == (55, 15, 0.7857)
    monkeypatch.setattr(e2e.replay, "http_get", lambda url: (503, ""))
    assert e2e.replay.scrape_metrics("http://x", e2e.POOL_METRICS) is None


def test_dry_run_prints_every_arm_and_the_checkpoint_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert e2e.main("glm-shape-h200", tmp_path, python=Path("py"), dry_run=True) == 0
    out = capsys.readouterr().out
    assert "--preset glm-shape" in out
    serves = [line for line in out.splitlines() if line.startswith("vllm serve ")]
    assert len(serves) == 2 * 11  # 2 routers x (6 arms, 5 of them again with ngram speculation)
    assert "--cpu-offload-gb" in out and "--offload-backend prefetch" in out


def test_spec_only_starts_only_the_speculative_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert e2e.main(
        "glm-shape-h200", tmp_path, python=Path("py"), arms=["resident", "pool"],
        routers=["skewed"], plain=False, ttft=False, dry_run=True,
    ) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    serves = [line for line in lines if line.startswith("vllm serve ")]
    assert len(serves) == 2 and all("--speculative-config" in line for line in serves)
    with pytest.raises(e2e.HarnessError, match="--spec-only and --no-spec"):
        e2e.main("glm-shape-h200", tmp_path, python=Path("py"), speculative=False, plain=False)


def _dry_run_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str], **options: Any) -> list[str]:
    """What a dry run of the profile's pool and pool-host-view arms (skewed router, no
    ngram servers) prints, with ``options`` for :func:`e2e.main`."""
    assert e2e.main(
        "glm-shape-h200", tmp_path, python=Path("py"), arms=["pool", "pool-host-view"],
        routers=["skewed"], speculative=False, dry_run=True, **options,
    ) == 0  # fmt: skip
    return capsys.readouterr().out.splitlines()


def test_pool_rows_size_every_pool_arm_in_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Trees whose -gb counts different things compare at equal rows per layer.
    serves = [line for line in _dry_run_lines(tmp_path, capsys, pool_rows=32)
              if line.startswith("vllm serve ")]  # fmt: skip
    assert len(serves) == 2
    for line in serves:
        assert "--moe-expert-pool-rows 32" in line and "--moe-expert-pool-gb" not in line
    assert "--no-moe-expert-pool-prefill-staging" in serves[1]
    default = [line for line in _dry_run_lines(tmp_path, capsys) if line.startswith("vllm serve ")]
    assert all("--moe-expert-pool-gb 8.859" in line for line in default)
    assert not any("--moe-expert-pool-rows" in line for line in default)
    with pytest.raises(e2e.HarnessError, match="--pool-rows takes a positive"):
        e2e.main("glm-shape-h200", tmp_path, python=Path("py"), pool_rows=0, dry_run=True)


def test_online_runs_arrive_as_poisson_with_lengths_drawn_from_the_ranges(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The online runs alone: per server (pool, then pool-host-view, whose prefill differs
    # and so is measured online too) the warm-up, then one run per rate.
    lines = _dry_run_lines(tmp_path, capsys, decode=False, ttft=False)
    benches = [line for line in lines if "bench serve" in line and "online-" in line]
    measure = e2e.load_profiles()["glm-shape-h200"].measure
    assert len(benches) == 2 * len(measure.online_rates) > 0
    assert [b for b in benches if "online-skewed-pool-host-view-" in b] == benches[3:]
    for rate, bench in zip(measure.online_rates * 2, benches, strict=True):
        argv = shlex.split(bench)
        value = dict(itertools.pairwise(argv))
        assert value["--request-rate"] == f"{rate:g}" and value["--burstiness"] == "1"
        prompts = measure.online_prompts(rate)
        assert value["--num-prompts"] == value["--max-concurrency"] == str(prompts)
        ratio = json.loads(value["--random-range-ratio"])
        # vLLM's random dataset draws floor(len * (1 - r)) .. ceil(len * (1 + r)).
        for key, (low, high) in (("input", measure.online_input_lens),
                                 ("output", measure.online_output_lens)):  # fmt: skip
            length = int(value[f"--random-{key}-len"])
            assert math.floor(length * (1 - ratio[key])) == low
            assert math.ceil(length * (1 + ratio[key])) == high
    assert measure.online_prompts(0.01) == 4  # a few requests even at a low rate
    # --online-rates replaces the profile's rates, in the order given.
    lines = _dry_run_lines(tmp_path, capsys, decode=False, ttft=False, online_rates=[0.5, 0.2])
    rates = [dict(itertools.pairwise(shlex.split(line)))["--request-rate"]
             for line in lines if "bench serve" in line and "online-" in line]  # fmt: skip
    assert rates == ["0.5", "0.2"] * 2
    with pytest.raises(e2e.HarnessError, match="--online-rates sets the online runs"):
        e2e.main("glm-shape-h200", tmp_path, python=Path("py"), online=False, online_rates=[1])
    with pytest.raises(e2e.HarnessError, match="request rates above 0"):
        e2e.main("glm-shape-h200", tmp_path, python=Path("py"), online_rates=[0.0])


def test_a_bench_run_sends_the_same_requests_whatever_the_arm_or_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The request seed belongs to the run ("online-r0.3"), not to its place in the list:
    # run 31's host-view online run (--no-ttft --no-decode) drew other prompts than
    # run 28's pool run of the same rate (full profile) while seeds were counted.
    def seeds(**options: Any) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for line in _dry_run_lines(tmp_path, capsys, **options):
            if "bench serve" in line:
                value = dict(itertools.pairwise(shlex.split(line)))
                run = re.sub(r"-skewed-pool(-host-view)?", "", value["--result-filename"])
                found.setdefault(run, set()).add(value["--seed"])
        return found

    full, online_only = seeds(), seeds(decode=False, ttft=False, online_rates=[0.3])
    assert all(len(s) == 1 for s in full.values())  # both arms, one seed per run
    assert online_only["online-r0.3.json"] == full["online-r0.3.json"]
    assert online_only["warmup.json"] == full["warmup.json"]
    assert len({next(iter(s)) for s in full.values()}) == len(full) > 5  # runs differ


def test_online_rows_summarize_latency_throughput_and_staging() -> None:
    data = {
        "request_rate": 0.3, "prompts": 36,
        "bench": {"completed": 36, "p50_ttft_ms": 1500.0, "p99_ttft_ms": 4200.0,
                  "p50_itl_ms": 95.0, "p99_itl_ms": 560.0, "request_throughput": 0.29,
                  "output_throughput": 83.5},
        "pool_counters": {"hit_rate": 0.61}, "pool_staged": {"gib": 850.0, "steps": 32},
    }  # fmt: skip
    row = e2e.online_row({"arm": "pool", "router": "skewed", "outcome": "ok"}, data)
    assert row["ttft_s_p50"] == 1.5 and row["ttft_s_p99"] == 4.2
    assert row["itl_ms_p99"] == 560.0 and row["request_throughput"] == 0.29
    assert row["pool_hit_rate"] == 0.61 and row["pool_staged_gib"] == 850.0
    before = "x 100.00 GiB staged for 4 prefill steps.\n"
    during = "y 600.00 GiB staged for 20 prefill steps.\nz 950.50 GiB staged for 36 prefill steps."
    assert e2e.staged_since(before, during) == {"gib": 850.5, "steps": 32}
    assert e2e.staged_since("", during) == {"gib": 950.5, "steps": 36}
    assert e2e.staged_since(before, "no stats line") is None


def test_no_decode_keeps_only_the_warm_up_and_ttft_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _dry_run_lines(tmp_path, capsys, decode=False, online=False)
    assert len([line for line in lines if line.startswith("vllm serve ")]) == 2
    benches = [line for line in lines if "bench serve" in line]
    assert len(benches) == 2 * 3  # per server: the warm-up and the two TTFT lengths
    assert not any("--ignore-eos" in b and "--max-concurrency 32" in b for b in benches)
    with pytest.raises(e2e.HarnessError, match="add --no-spec"):
        e2e.main("glm-shape-h200", tmp_path, python=Path("py"), decode=False)
    with pytest.raises(e2e.HarnessError, match="leave nothing to measure"):
        e2e.main(
            "glm-shape-h200", tmp_path, python=Path("py"), speculative=False, decode=False,
            ttft=False, online=False,
        )  # fmt: skip
    with pytest.raises(e2e.HarnessError, match="--concurrency sets the decode runs"):
        e2e.main(
            "glm-shape-h200", tmp_path, python=Path("py"), speculative=False, decode=False,
            concurrency=[4],
        )  # fmt: skip


def test_acceptance_rate_covers_the_bench_alone() -> None:
    # Counters since the server started include the warm-up's greedy tokens.
    old = {"spec_decode_since_start": {"acceptance_rate": 0.0102},
           "summary": {"spec_decode_acceptance_rate_pct": 0.0}}  # fmt: skip
    assert e2e.acceptance_rate(old) == 0.0
    assert e2e.acceptance_rate({"spec_decode": {"acceptance_rate": 0.25}, **old}) == 0.25
    assert e2e.acceptance_rate({"summary": {"spec_decode_acceptance_rate_pct": None}}) is None
    before = {"vllm:spec_decode_num_drafts_total": 10.0,
              "vllm:spec_decode_num_draft_tokens_total": 30.0,
              "vllm:spec_decode_num_accepted_tokens_total": 9.0}  # fmt: skip
    after = {k: v * 2 for k, v in before.items()}
    assert e2e.replay.spec_decode_delta(before, after)["acceptance_rate"] == 0.3


def test_unknown_arms_are_refused_with_the_known_ones() -> None:
    with pytest.raises(e2e.HarnessError, match="arms: resident, pool"):
        e2e.main("glm-shape-h200", Path("/nonexistent"), python=Path("py"), arms=["nope"])


def _facts(offload: str, **facts: list[float]) -> dict[str, Any]:
    return {"offload": offload, "budget": {"fraction": 0.25}, "facts": facts}


def test_gpu_expert_bytes_of_each_arm_from_its_log_lines() -> None:
    spec = checkpoint_routed.PRESETS["glm-shape"]  # 35.44 GiB of experts: budget 8.86 GiB
    # Run 17's servers: the pool's bank and prefill buffers are in the loading figure.
    pool = e2e.gpu_expert_bytes(_facts(
        "pool", model_loading_gib=[12.32], pool_bank_gib=[9.7], pool_rows_per_layer=[32.0],
        pool_staging_buffers=[2.0], pool_staging_buffer_gib=[0.84]), spec)  # fmt: skip
    # Its 32 rows per layer are the budget; its staging rows and prefill buffers are on
    # top of it, and count: 11.44 GiB is 29% over the budget, not held.
    assert pool["staging_gib"] == pytest.approx(2.52, abs=0.01)
    assert pool["expert_gib_on_gpu"] == pytest.approx(11.44, abs=0.01)
    assert e2e.over_budget(pool) == pytest.approx(0.29, abs=0.005)
    assert pool["holds_budget"] is False and "cache_gib" not in pool
    # The prefetch offloader's buffer comes after the loading line: on top of it.
    prefetch = e2e.gpu_expert_bytes(_facts(
        "prefetch", model_loading_gib=[10.21], prefetch_buffer_gb=[0.906]), spec)  # fmt: skip
    assert prefetch["expert_gib_on_gpu"] == pytest.approx(10.17, abs=0.01)
    assert prefetch["staging_gib"] == pytest.approx(0.84, abs=0.01)
    assert prefetch["holds_budget"] is False  # 15% over with its buffer
    # A pool whose bank (23 rows per layer and 128 staging rows) and buffers come within
    # 2% of the budget holds it: 8.90 GiB, 0.5% over.
    sized = e2e.gpu_expert_bytes(_facts(
        "pool", model_loading_gib=[9.78], pool_bank_gib=[7.21], pool_rows_per_layer=[23.0],
        pool_staging_buffers=[2.0], pool_staging_buffer_gib=[0.84]), spec)  # fmt: skip
    assert sized["holds_budget"] and sized["staging_gib"] == pytest.approx(2.52, abs=0.01)
    # UVA's 8.84 GiB, no staging, is the budget less 0.2%: held.
    uva = e2e.gpu_expert_bytes(_facts("uva", model_loading_gib=[9.72]), spec)
    assert uva["holds_budget"] and e2e.over_budget(uva) == pytest.approx(-0.002, abs=0.001)
    resident = e2e.gpu_expert_bytes(_facts("none", model_loading_gib=[36.37]), spec)
    assert resident["holds_budget"] is None
    assert e2e.gpu_expert_bytes(_facts("uva"), spec)["expert_gib_on_gpu"] is None


def _three_run_summary() -> dict[str, Any]:
    runs = {"2026-01-01-run1-a": {"date": "2026-01-01"},
            "2026-01-02-run2-b": {"date": "2026-01-02"},
            "2026-01-03-base": {"date": "2026-01-03"}}  # fmt: skip
    row = {"router": "skewed", "arm": "pool", "spec_tokens": 0, "concurrency": 1}
    summary = {
        "runs": runs, "budget_fraction": 0.25, "budget_gib": 8.86, "servers": [],
        "ttft": [{"run": "2026-01-03-base", "series_hash": "h3", "router": "skewed",
                  "arm": "resident", "input_len": 12500, "ttft_s": 1.317}],
        "decode": [
            {**row, "run": "2026-01-02-run2-b", "series_hash": "h2", "temperature": 1.0,
             "tok_s": 51.93, "pool_hit_rate": 0.7047, "pool_mib_per_step": 657.0},
            {**row, "run": "2026-01-01-run1-a", "series_hash": "h1", "temperature": 1.0,
             "tok_s": 51.28},
            {**row, "run": "2026-01-03-base", "series_hash": "h3", "temperature": 0.0,
             "tok_s": 228.1},  # greedy: left out
            {**row, "concurrency": 32, "run": "2026-01-01-run1-a", "series_hash": "h1",
             "temperature": 1.0, "tok_s": 4.0},
        ],
    }  # fmt: skip
    return summary


def test_the_matrix_keeps_each_cells_newest_sampled_value() -> None:
    text = e2e.matrix_markdown(_three_run_summary())
    assert "| skewed | resident | 1.32 (base, `h3`) |" in text
    assert "| skewed | pool | 51.9 (run 2, `h2`) | 4.00 (run 1, `h1`) |" in text
    assert "228" not in text
    assert "| skewed | pool | 70.5%, 0.64 GiB per step | - |" in text  # the pool's counters


def test_an_arm_whose_pool_flag_changed_shows_only_its_newest_configurations_cells() -> None:
    """Run 1 sized the pool by rows (its 32-request decode and TTFT), run 2 by GiB (one
    request): the pool's cells come from run 2 alone, and the rows-sized TTFT and
    32-request decode are not shown beside them. UVA kept its flag: both runs count."""
    summary = _three_run_summary()
    server = {"router": "skewed", "spec_tokens": 0, "outcome": "runs",
              "expert_gib_on_gpu": 9.0, "holds_budget": True}  # fmt: skip
    summary["servers"] = [
        {**server, "arm": "pool", "run": "2026-01-01-run1-a", "series_hash": "h1",
         "pool_flag": "--moe-expert-pool-rows 32", "expert_gib_on_gpu": 11.4},
        {**server, "arm": "pool", "run": "2026-01-02-run2-b", "series_hash": "h2",
         "pool_flag": "--moe-expert-pool-gb 8.859", "host_gib_taken": 38.6},
        {**server, "arm": "uva", "run": "2026-01-01-run1-a", "series_hash": "h1",
         "pool_flag": None},
        {**server, "arm": "uva", "run": "2026-01-02-run2-b", "series_hash": "h2",
         "pool_flag": None},
    ]  # fmt: skip
    summary["ttft"].append({"run": "2026-01-01-run1-a", "series_hash": "h1",
                            "router": "skewed", "arm": "pool", "input_len": 12500,
                            "ttft_s": 1.07})  # fmt: skip
    row = {"router": "skewed", "spec_tokens": 0, "series_hash": "h1", "temperature": 1.0,
           "run": "2026-01-01-run1-a"}  # fmt: skip
    summary["decode"].append({**row, "arm": "uva", "concurrency": 32, "tok_s": 2.9})
    cells = e2e.newest_cells(summary)
    assert cells["servers"][("pool",)]["pool_flag"] == "--moe-expert-pool-gb 8.859"
    assert ("skewed", "pool", 12500) not in cells["ttft"]
    assert ("skewed", "pool", 0, 32) not in cells["decode"]
    assert cells["decode"][("skewed", "pool", 0, 1)]["tok_s"] == 51.93
    assert cells["decode"][("skewed", "uva", 0, 32)]["tok_s"] == 2.9
    pool = {row[0]: row for row in document.which_flag_cells(summary)}[
        "`--moe-expert-pool-gb 8.859`"
    ]
    assert pool[1:6] == ["9.0 GiB, budget held", "38.6", "- / -", "51.9 / -", "- / -"]


def test_plots_of_several_runs_draw_the_matrix_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: dict[str, list[Mapping[str, Any]]] = {}
    monkeypatch.setattr(e2e, "_panels", lambda rows, png, draw: drawn.setdefault(png.name, rows))
    e2e.plot(_three_run_summary(), tmp_path)
    assert sorted((r["concurrency"], r["tok_s"]) for r in drawn["decode.png"]) == [
        (1, 51.93), (32, 4.0),
    ]  # fmt: skip
    assert all(e2e._label(r) == r["arm"] for r in drawn["decode.png"] + drawn["ttft.png"])


def test_plots_of_the_committed_summary(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib")
    root = Path(__file__).resolve().parent.parent
    summary = json.loads((root / "results/e2e/summary.json").read_text())
    written = e2e.plot(summary, tmp_path)
    assert [p.name for p in written] == ["ttft.png", "decode.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)
    # The committed summary is what summarize_runs gives over the committed runs, each
    # row tagged with its run and series.
    folders = sorted(p.parent for p in (root / "results/e2e").glob("*/server-*.json"))
    again = e2e.summarize_runs(sorted(set(folders)))
    assert again["decode"] == summary["decode"] and again["servers"] == summary["servers"]
    # Every run folder is in the summary: as measured rows, or (a run cut by its time
    # limit before any bench finished) as the benches it planned and did not measure.
    measured = {r["run"] for r in summary["decode"] + summary["ttft"]}
    cut = {name.split("/")[0] for name in summary["not_measured"]}
    assert measured | cut == {f.name for f in folders}
    assert all(r["series_hash"] for r in summary["decode"] + summary["ttft"])
    assert {r["base"] for r in summary["decode"] + summary["ttft"]} == {"0.33.0"}
    assert all(r["attention_backend"] != "no server record" for r in summary["ttft"])
    assert (root / "results/e2e/matrix.md").read_text() == e2e.matrix_markdown(summary)


# --- the runner, against test_replay's fake `vllm` CLI ----------------------------------------


def _tiny_runner(out: Path, arms: tuple[str, ...] = ("resident", "pool")) -> e2e.Runner:
    import sys

    script = Path(os.environ["FAKE_VLLM_DIR"]).parent / "fake_vllm.py"  # test_replay's `fake`

    profile = e2e.Profile(
        name="tiny", description="", preset="glm-shape", routers=("skewed",), budget=0.25,
        server={"model": "synthetic", "max_num_seqs": 1},
        arms={"resident": e2e.Arm("resident", "none"), "pool": e2e.Arm("pool", "pool")},
        measure=e2e.Measure(warmup_input_len=10, ttft_input_lens=(100,), decode_concurrency=(1,),
                            decode_output_len=8),
        startup_timeout_s=30, bench_timeout_s=30,
    )  # fmt: skip
    prov = {k: "test" for k in e2e.results.REQUIRED}
    return e2e.Runner(
        profile, out, [sys.executable, str(script)], {"skewed": "m"}, SMALL, arms, ("skewed",),
        speculative=False, provenance=lambda: dict(prov), echo=lambda _: None,
    )  # fmt: skip


@pytest.mark.usefixtures("fake")
def test_runner_records_plan_servers_and_runs_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    written = {p.name for p in _tiny_runner(out).run()}
    assert {"server-skewed-pool.json", "ttft-skewed-pool-in100.json",
            "decode-skewed-resident-c1.json"} <= written  # fmt: skip
    summary = e2e.summarize(out)
    assert summary["not_measured"] == []
    assert {(r["arm"], r["outcome"]) for r in summary["decode"]} == {
        ("resident", "ok"), ("pool", "ok"),
    }  # fmt: skip
    benches = (Path(os.environ["FAKE_VLLM_DIR"]) / "bench.jsonl").read_text().count("\n")
    again = _tiny_runner(out).run()
    assert [p.name for p in again if not p.name.startswith("plan-")] == []  # all skipped
    assert (Path(os.environ["FAKE_VLLM_DIR"]) / "bench.jsonl").read_text().count("\n") == benches


def _with_measure(runner: e2e.Runner, **changes: Any) -> e2e.Runner:
    measure = dataclasses.replace(runner.profile.measure, **changes)
    runner.profile = dataclasses.replace(runner.profile, measure=measure)
    return runner


@pytest.mark.usefixtures("fake")
def test_online_runs_are_recorded_summarized_and_tabled(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = _with_measure(
        _tiny_runner(out, arms=("pool",)),
        online_rates=(0.5, 2.0),
        online_duration_s=4,
        ttft_input_lens=(),
        decode_concurrency=(),
    )
    written = {p.name for p in runner.run()}
    assert {"online-skewed-pool-r0.5.json", "online-skewed-pool-r2.json"} <= written
    record = json.loads((out / "online-skewed-pool-r2.json").read_text())
    assert record["kind"] == "e2e-online" and record["data"]["outcome"] == "ok"
    assert record["data"]["prompts"] == 8 and record["data"]["request_rate"] == 2.0
    summary = e2e.summarize(out)
    for key in ("servers", "decode", "ttft", "online"):
        for row in summary[key]:
            row.update(run="2026-12-03-run1-tiny", series_hash="abc")
    rows = {r["request_rate"]: r for r in summary["online"]}
    assert rows[2.0]["itl_ms_p99"] == 30.0 and rows[2.0]["request_throughput"] == 2.0
    assert rows[0.5]["attention_backend"] != "no server record"
    assert rows[2.0]["itl_ms_p90"] == 20.0 and rows[2.0]["completed"] == 8
    table = e2e.matrix_markdown(summary)
    assert "## Online serving: Poisson arrivals" in table
    # 8 completed requests: the tail shown is the p90
    assert "| skewed | pool | 2 | 8 |" in table and "9.00 / 20.0 (p90)" in table


@pytest.mark.usefixtures("fake")
def test_a_deadline_skips_the_decode_bench_that_cannot_finish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    # The fake's warm-up streams an output every 9 ms: 100,000 more tokens need at
    # least 0.9 x 9 ms x 100,000 = 810 s.
    runner = _with_measure(_tiny_runner(out, arms=("pool",)), decode_output_len=100_001)
    runner.deadline = runner.clock() + 300
    runner.run()
    assert (out / "ttft-skewed-pool-in100.json").exists()
    assert not (out / "decode-skewed-pool-c1.json").exists()
    assert e2e.summarize(out)["not_measured"] == ["decode-skewed-pool-c1"]
    assert "decode-skewed-pool-c1: skipped, it needs at least 810 s" in capsys.readouterr().err
    assert len(runner.startups) == 1
    first_log = (out / "logs/skewed-pool.server.log").read_text()
    # With time to spare the same bench runs, from a second start of the server; the
    # first start's log and record are kept beside it.
    runner.deadline = runner.clock() + 1000
    runner.run()
    assert (out / "decode-skewed-pool-c1.json").exists()
    assert (out / "logs/skewed-pool.server-1.log").read_text() == first_log
    assert (out / "logs/server-skewed-pool-1.json").exists()
    assert (out / "server-skewed-pool.json").exists()
    assert (out / "logs/skewed-pool.server.log").exists()
    assert [r["arm"] for r in e2e.summarize(out)["servers"]] == ["pool"]


@pytest.mark.usefixtures("fake")
def test_a_decode_bench_is_bounded_by_the_earlier_ones_at_fewer_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The fake's step is 9 ms x requests; each bench has 10,000 steps after the first.
    up = _with_measure(_tiny_runner(tmp_path / "up", arms=("pool",)),
                       decode_output_len=10_001, decode_concurrency=(4, 16))  # fmt: skip
    up.deadline = up.clock() + 200  # what the servers' starts and the benches take is spare
    up.run()
    # c=4 needs the warm-up's 81 s; c=16 the c=4 bench's 0.9 x 36 ms x 10,000 = 324 s.
    assert (tmp_path / "up/decode-skewed-pool-c4.json").exists()
    assert "decode-skewed-pool-c16: skipped, it needs at least 324 s" in capsys.readouterr().err
    # A bench at more requests does not bound one at fewer.
    down = _with_measure(_tiny_runner(tmp_path / "down", arms=("pool",)),
                         decode_output_len=10_001, decode_concurrency=(16, 4))  # fmt: skip
    down.deadline = down.clock() + 200  # c=4 bounded by c=16's bench would need 1,296 s
    down.run()
    assert (tmp_path / "down/decode-skewed-pool-c16.json").exists()
    assert (tmp_path / "down/decode-skewed-pool-c4.json").exists()


@pytest.mark.usefixtures("fake")
def test_a_speculative_step_may_stream_one_plus_k_tokens(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runner = _with_measure(_tiny_runner(out, arms=("pool",)), decode_output_len=100_001,
                           spec_concurrency=(1,))  # fmt: skip
    runner.speculative, runner.plain = True, False
    runner.deadline = runner.clock() + 300  # 810 s / (1 + 3 tokens) = 202.5 s fits
    runner.run()
    assert (out / "decode-skewed-pool-ngram-c1.json").exists()


@pytest.mark.usefixtures("fake")
def test_a_deadline_skips_a_server_start_faster_than_any_seen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    runner = _tiny_runner(out)
    runner.startups = [80.0, 50.0]  # earlier starts of this run took 80 and 50 s
    runner.deadline = runner.clock() + 40
    assert [p.name for p in runner.run() if not p.name.startswith("plan-")] == []
    err = capsys.readouterr().err
    assert "skewed/resident server: skipped, it needs at least 50 s" in err
    assert "skewed/pool server: skipped" in err
    assert not list(out.glob("server-*.json"))
    assert e2e.summarize(out)["not_measured"] == [
        "decode-skewed-pool-c1", "decode-skewed-resident-c1", "server-skewed-pool",
        "server-skewed-resident", "ttft-skewed-pool-in100", "ttft-skewed-resident-in100",
    ]  # fmt: skip
    # 60 s left: the fastest start fits, so the servers start.
    runner.deadline = runner.clock() + 60
    runner.run()
    assert {p.name for p in out.glob("server-*.json")} == {
        "server-skewed-pool.json", "server-skewed-resident.json",
    }  # fmt: skip


@pytest.mark.usefixtures("fake")
def test_before_its_first_start_a_run_assumes_the_profiles_startup_floor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each replay of a device call is a process of its own: without the floor, the
    # last replay of session 13's call 3 started a server with 65 s left.
    runner = _tiny_runner(tmp_path / "out", arms=("pool",))
    runner.profile = dataclasses.replace(runner.profile, startup_floor_s=75.0)
    runner.deadline = runner.clock() + 60
    runner.run()
    assert "skewed/pool server: skipped, it needs at least 75 s" in capsys.readouterr().err
    assert not list((tmp_path / "out").glob("server-*.json"))
    runner.deadline = runner.clock() + 80
    runner.run()
    assert (tmp_path / "out/server-skewed-pool.json").exists()


def test_the_glm_profile_has_a_startup_floor_and_unknown_keys_are_refused(
    tmp_path: Path,
) -> None:
    assert e2e.load_profiles()["glm-shape-h200"].startup_floor_s == 75
    bad = tmp_path / "p.toml"
    bad.write_text(e2e.PROFILES.read_text().replace("startup_floor_s", "startup_flor_s"))
    with pytest.raises(e2e.HarnessError, match=r"unknown keys \['startup_flor_s'\]"):
        e2e.load_profiles(bad)
    bad.write_text("stray = 1\n" + e2e.PROFILES.read_text())
    with pytest.raises(e2e.HarnessError, match="stray = 1 is not a profile table"):
        e2e.load_profiles(bad)


def test_the_run_deadline_is_the_earlier_of_deadline_s_and_device_runs_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = {e2e.TIME_LEFT_ENV: "300.0"}
    assert e2e.run_deadline(1000.0, None, {}) is None
    assert e2e.run_deadline(1000.0, 540.0, {}) == 1540.0
    assert e2e.run_deadline(1000.0, None, env) == 1000.0 + 300 - e2e.WIND_DOWN_S
    assert "interrupts this run in 300 s" in capsys.readouterr().err
    assert e2e.run_deadline(1000.0, 200.0, env) == 1200.0  # the tighter one wins
    assert "interrupts" not in capsys.readouterr().err
    with pytest.raises(e2e.HarnessError, match="is not a number of seconds"):
        e2e.run_deadline(0.0, None, {e2e.TIME_LEFT_ENV: "soon"})


@pytest.mark.usefixtures("fake")
def test_a_server_that_does_not_start_is_not_a_start_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    runner = _tiny_runner(tmp_path / "out", arms=("pool",))
    runner.run()
    assert runner.startups == []


def test_step_bound_is_nine_tenths_of_the_median_itl() -> None:
    assert e2e.step_bound_s({}) == 0.0  # no result: no bound
    bench = {"median_itl_ms": 522.4, "median_tpot_ms": 524.4}
    assert e2e.step_bound_s(bench) == pytest.approx(0.9 * 0.5224)
    assert e2e.step_bound_s({"median_tpot_ms": 9.5}) == pytest.approx(0.9 * 0.0095)


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(e2e.HarnessError, match="--deadline-s must be a positive"):
        e2e.main("glm-shape-h200", Path("/nonexistent"), python=Path("py"), deadline_s=0)


def test_main_hands_the_deadline_to_the_runner_and_writes_the_summary_when_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float | None] = []

    def cut(self: e2e.Runner) -> list[Path]:
        seen.append(None if self.deadline is None else self.deadline - self.clock())
        raise KeyboardInterrupt  # what device_run's time limit sends

    monkeypatch.setattr(e2e.checkpoint_routed, "write", lambda *a, **k: None)
    monkeypatch.setattr(e2e.replay, "load_nvml", lambda: None)
    monkeypatch.setattr(e2e.replay, "server_versions", lambda _: dict.fromkeys(
        ("torch", "cuda", "vllm"), "test"))  # fmt: skip
    monkeypatch.setattr(e2e.Runner, "run", cut)
    monkeypatch.delenv(e2e.TIME_LEFT_ENV, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt):
        e2e.main("glm-shape-h200", out, python=Path("py"), deadline_s=540)
    assert seen and seen[0] is not None and 530 < seen[0] <= 540
    assert json.loads((out / "summary.json").read_text())["decode"] == []
    # Under device_run.py without --deadline-s, the time it gives bounds the run.
    monkeypatch.setenv(e2e.TIME_LEFT_ENV, "400")
    with pytest.raises(KeyboardInterrupt):
        e2e.main("glm-shape-h200", out, python=Path("py"))
    assert seen[1] is not None and 375 < seen[1] <= 400 - e2e.WIND_DOWN_S


@pytest.mark.usefixtures("fake")
def test_a_server_that_does_not_start_is_a_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    out = tmp_path / "out"
    _tiny_runner(out, arms=("pool",)).run()
    server = json.loads((out / "server-skewed-pool.json").read_text())["data"]
    assert server["outcome"] == "does not run"
    assert "use --moe-expert-pool-rows <= 193" in server["exception"]
    assert "--moe-expert-pool-gb" in " ".join(
        json.loads((out / "server-skewed-pool.json").read_text())["provenance"]["server_argv"]
    )
    assert e2e.summarize(out)["not_measured"] == [
        "decode-skewed-pool-c1", "ttft-skewed-pool-in100",
    ]  # fmt: skip


def test_the_attention_backend_each_server_used_comes_from_its_log() -> None:
    fa3 = (
        "INFO [cuda.py:550] Using FLASH_ATTN attention backend out of potential backends: "
        "['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN'].\n"
        "INFO [flash_attn.py:1132] Using FlashAttention version 3\n"
    )
    assert e2e.attention_backend(fa3) == "FLASH_ATTN (FA3)"
    chosen = "INFO [cuda.py:489] Using AttentionBackendEnum.TRITON_ATTN backend.\n"
    assert e2e.attention_backend(chosen) == "TRITON_ATTN"
    assert e2e.attention_backend("INFO nothing about attention\n") == "not logged"


def test_which_flag_counts_everything_on_the_gpu_against_the_budget(tmp_path: Path) -> None:
    """Run 28's servers (run 26's UVA): the pool's 11.45 GiB (32 rows per layer, 128
    staging rows, two prefill buffers) is 29% over the 8.86 GiB budget and the prefetch
    offloader's 10.18 GiB, its buffer included, 15%; only UVA's 8.84 GiB holds it. Each
    pool row names the flag its server ran: an older run's rows, a newer run's GiB."""
    run = tmp_path / "2026-12-03-run28"
    run.mkdir()
    serve = ["vllm", "serve", "ckpt", "--moe-backend", "marlin"]
    servers = {
        "resident": (_server("resident", "none", 36.38), serve),
        "uva": (_server("uva", "uva", 9.72, uva_offloaded_gib=[26.66]),
                [*serve, "--cpu-offload-gb", "26.578"]),
        "prefetch": (_server("prefetch", "prefetch", 10.22, prefetch_buffer_gb=[0.906]),
                     [*serve, "--offload-backend", "prefetch"]),
        "pool": (_server("pool", "pool", 12.33, pool_bank_gib=[9.7],
                         pool_rows_per_layer=[32.0], pool_staging_buffers=[2.0],
                         pool_staging_buffer_gib=[0.84]),
                 [*serve, "--moe-expert-pool-rows", "32"]),
        # --moe-expert-pool-gb 8.859 without staging: 28 rows per layer, 3.0% under.
        "pool-host-view": (_server("pool-host-view", "pool", 9.47, pool_bank_gib=[8.59],
                                   pool_rows_per_layer=[28.0]),
                           [*serve, "--moe-expert-pool-gb", "8.859",
                            "--no-moe-expert-pool-prefill-staging"]),
    }  # fmt: skip
    for arm, (data, argv) in servers.items():
        _write_record(run, f"server-skewed-{arm}", "e2e-server", data, argv)
    summary = e2e.summarize_runs([run])
    kept = {row[0]: row[1] for row in document.which_flag_cells(summary)}
    assert kept == {
        "none: every expert on the GPU (reference)": "35.5 GiB",
        "`--cpu-offload-gb` (UVA)": "8.8 GiB, budget held",
        "`--offload-backend prefetch`": "10.2 GiB, 15% over budget",
        "`--moe-expert-pool-rows 32`": "11.4 GiB, 29% over budget",
        "`--moe-expert-pool-gb 8.859 --no-moe-expert-pool-prefill-staging`":
            "8.6 GiB, budget held",
        # No server of this arm in the summary: its row says nothing was measured.
        f"`{document.POOL_FLAG_UNKNOWN} --moe-expert-pool-admission frequency`": "-",
    }  # fmt: skip
    matrix = e2e.matrix_markdown(summary)
    assert "| pool | 11.45 GiB | 2.52 GiB | no (+29.2%) |" in matrix
    assert "| uva | 8.84 GiB | 0.00 GiB | yes (-0.2%) |" in matrix


def test_which_flag_shows_the_online_rate_it_names_and_no_other() -> None:
    summary = _three_run_summary()
    online = {"router": "skewed", "run": "2026-01-02-run2-b", "series_hash": "h2",
              "outcome": "ok", "request_throughput": 0.2481, "itl_ms_p90": 146.3,
              "itl_ms_p99": 541.9, "completed": 36}  # fmt: skip
    summary["online"] = [
        {**online, "arm": "pool", "request_rate": document.WHICH_FLAG_ONLINE_RATE},
        {**online, "arm": "uva", "request_rate": 0.1},  # another rate: not shown
        {**online, "arm": "resident", "request_rate": document.WHICH_FLAG_ONLINE_RATE,
         "outcome": "cut"},  # not completed: not shown
        # 120 requests support a p99
        {**online, "arm": "prefetch", "request_rate": document.WHICH_FLAG_ONLINE_RATE,
         "completed": 120},
    ]  # fmt: skip
    rows = {row[0]: row for row in document.which_flag_cells(summary)}
    pool = next(flag for flag in rows if flag == f"`{document.POOL_FLAG_UNKNOWN}`")
    # 36 requests: the p90, not a p99 that is about the worst request
    assert rows[pool][-1] == "146 (p90 of 36)"
    assert rows["`--offload-backend prefetch`"][-1] == "542 (p99 of 120)"
    assert rows["`--cpu-offload-gb` (UVA)"][-1] == "-"
    assert rows["none: every expert on the GPU (reference)"][-1] == "-"


# --- host memory each server took ---------------------------------------------------------------


def _meminfo(path: Path, used_gib: float, total_gib: int = 128) -> Path:
    """A fake ``/proc/meminfo`` with ``used_gib`` of ``total_gib`` in use."""
    kib = 2**20
    available = round((total_gib - used_gib) * kib)
    path.write_text(
        f"MemTotal:       {total_gib * kib} kB\nMemFree:        1000 kB\n"
        f"MemAvailable:   {available} kB\nCached:         5000 kB\n"
    )
    return path


def test_host_memory_taken_is_in_use_when_healthy_less_before_the_start(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    before = e2e.replay.host_used_bytes(_meminfo(meminfo, 10.0))
    healthy = e2e.replay.host_used_bytes(_meminfo(meminfo, 36.6))
    assert (before, healthy) == (10 * 2**30, round(36.6 * 2**20) * 1024)
    assert e2e.host_taken(before, healthy) == {
        "host_used_before_start": before, "host_used_healthy": healthy, "host_gib_taken": 26.6,
    }  # fmt: skip
    unreadable = e2e.replay.host_used_bytes(tmp_path / "missing")
    assert unreadable is None
    assert e2e.host_taken(unreadable, healthy)["host_gib_taken"] is None
    assert e2e.host_taken(before, None)["host_gib_taken"] is None  # never healthy


@pytest.mark.usefixtures("fake")
def test_each_server_records_the_host_memory_it_took_and_the_summary_carries_it(
    tmp_path: Path,
) -> None:
    """Read from a fake meminfo just before each start and once healthy: the resident
    arm's server took 4.5 GiB, the pool's 12.25 GiB; every arm reads the same way."""
    meminfo = tmp_path / "meminfo"
    used = iter([10.0, 14.5, 11.0, 23.25])  # resident before, healthy; pool before, healthy
    runner = _tiny_runner(tmp_path / "out")
    runner.host_used = lambda: e2e.replay.host_used_bytes(_meminfo(meminfo, next(used)))
    runner.run()
    assert next(used, None) is None  # two readings per server, no more
    out = tmp_path / "out"
    expected = {"resident": (10.0, 14.5, 4.5), "pool": (11.0, 23.25, 12.25)}
    for arm, (before, healthy, taken) in expected.items():
        data = json.loads((out / f"server-skewed-{arm}.json").read_text())["data"]
        assert data["host_used_before_start"] == int(before * 2**30)
        assert data["host_used_healthy"] == int(healthy * 2**30)
        assert data["host_gib_taken"] == taken
    rows = {r["arm"]: r for r in e2e.summarize(out)["servers"]}
    assert {arm: r["host_gib_taken"] for arm, r in rows.items()} == {"resident": 4.5, "pool": 12.25}
    assert rows["pool"]["host_used_before_start"] == 11 * 2**30
    assert rows["pool"]["host_used_healthy"] == int(23.25 * 2**30)


@pytest.mark.usefixtures("fake")
def test_a_server_that_never_gets_healthy_took_no_measured_host_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    out = tmp_path / "out"
    runner = _tiny_runner(out, arms=("pool",))
    runner.host_used = lambda: 8 << 30
    runner.run()
    server = json.loads((out / "server-skewed-pool.json").read_text())["data"]
    assert server["outcome"] == "does not run"
    assert server["host_used_before_start"] == 8 << 30
    assert server["host_used_healthy"] is None and server["host_gib_taken"] is None


def test_an_old_server_record_without_host_memory_reads_as_not_measured(tmp_path: Path) -> None:
    """Its summary row lacks the fields too (committed summaries stay what their runs
    give), and the table shows "-" for it."""
    _write_record(tmp_path, "server-skewed-uva", "e2e-server",
                  _server("uva", "uva", 9.72, uva_offloaded_gib=[26.66]))  # fmt: skip
    (row,) = e2e.summarize(tmp_path)["servers"]
    assert not set(e2e.HOST_FIELDS) & set(row)
    summary = e2e.summarize_runs([tmp_path])
    cells = {cells[0]: cells[2] for cells in document.which_flag_cells(summary)}
    assert cells["`--cpu-offload-gb` (UVA)"] == "-"


def test_which_flag_shows_each_arms_newest_measured_host_memory() -> None:
    """The pool's newest run could not read meminfo: its older run's value is shown; the
    UVA arm's plain server is from before servers measured it, so its ngram server's
    reading does not stand in for it; prefetch has no server at all."""
    summary = _three_run_summary()
    server = {"router": "skewed", "spec_tokens": 0, "outcome": "runs",
              "expert_gib_on_gpu": 9.0, "holds_budget": True}  # fmt: skip
    summary["servers"] = [
        {**server, "arm": "pool", "run": "2026-01-01-run1-a", "series_hash": "h1",
         "host_gib_taken": 31.26},
        {**server, "arm": "pool", "run": "2026-01-02-run2-b", "series_hash": "h2",
         "host_gib_taken": None},
        {**server, "arm": "pool", "run": "2026-01-01-run1-a", "series_hash": "h1",
         "host_gib_taken": 29.0, "spec_tokens": 3},
        {**server, "arm": "uva", "run": "2026-01-02-run2-b", "series_hash": "h2"},
        {**server, "arm": "uva", "run": "2026-01-02-run2-b", "series_hash": "h2",
         "host_gib_taken": 30.0, "spec_tokens": 3},
        {**server, "arm": "resident", "run": "2026-01-03-base", "series_hash": "h3",
         "expert_gib_on_gpu": 35.5, "holds_budget": None, "host_gib_taken": 1.04},
    ]  # fmt: skip
    host = {row[0]: row[2] for row in document.which_flag_cells(summary)}
    assert host == {
        "none: every expert on the GPU (reference)": "1.0",
        "`--cpu-offload-gb` (UVA)": "-",
        "`--offload-backend prefetch`": "-",
        f"`{document.POOL_FLAG_UNKNOWN}`": "31.3",
        f"`{document.POOL_FLAG_UNKNOWN} --no-moe-expert-pool-prefill-staging`": "-",
        f"`{document.POOL_FLAG_UNKNOWN} --moe-expert-pool-admission frequency`": "-",
    }
    # The run that gave the pool's host memory is named with the others.
    assert "h1" in document.which_flag_hashes(summary)


def test_an_old_summary_without_host_memory_renders_the_table(tmp_path: Path) -> None:
    """The committed summary, stripped of any host-memory field: the column is there, every
    cell of it is "-", and the conditions say what it would measure."""
    summary = json.loads((e2e.REPO / document.E2E_SUMMARY).read_text())
    for row in summary["servers"]:
        for key in e2e.HOST_FIELDS:
            row.pop(key, None)
    path = tmp_path / document.E2E_SUMMARY
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(summary))
    text = document.render_which_flag(document.Project(tmp_path, tmp_path, tmp_path))
    lines = text.splitlines()
    assert lines[0].startswith("| flag | experts on the GPU | host RAM taken, GiB | TTFT 12.5K")
    rows = [line.strip("|").split(" | ") for line in lines[2:] if line.startswith("| ")]
    assert len(rows) == len(document.WHICH_FLAG_ARMS)
    assert [row[2].strip() for row in rows] == ["-"] * len(rows)
    assert "MemTotal - MemAvailable" in text and "pinned pages" in text
