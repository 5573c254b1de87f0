"""The soak replay, against test_replay's fake `vllm` CLI and fake NVML: each goal check
passes where the fake behaves and fails where it does not."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from test_replay import FakeNvml, _Obj, fake  # noqa: F401 (fake: the fake `vllm` CLI fixture)

from harness import e2e, results, soak
from harness.checkpoint import Spec
from harness.checkpoint_routed import expert_bytes
from harness.project import HarnessError

# The fake serves top_k 4 of 16 experts and a vocabulary of 512 ids.
SPEC = Spec(layers=2, experts=16, top_k=4, hidden_size=256, moe_intermediate_size=256)
PROV = {k: "test" for k in results.REQUIRED}
ARMS = {"resident": e2e.Arm("resident", "none"), "pool": e2e.Arm("pool", "pool")}
TINY_E2E = e2e.Profile(
    name="tiny", description="", preset="glm-shape", routers=("skewed",), budget=0.5,
    server={"model": "synthetic", "max_model_len": 1024}, arms=ARMS, measure=e2e.Measure(),
    startup_timeout_s=30,
)  # fmt: skip
TINY = soak.Profile(
    name="tiny-soak", description="", e2e=TINY_E2E, router="skewed", arms=("pool", "resident"),
    bad_requests=tuple(soak.BAD_REQUESTS), faults=tuple(soak.FAULTS),
    greedy=soak.Greedy(prompts=2, prompt_len=8, max_tokens=8),
    churn=soak.Churn(clients=4, duration_s=0.8, prompt_len=(4, 64), max_tokens=(2, 12),
                     request_timeout_s=10),
    shutdown=soak.Shutdown(in_flight=2, max_tokens=400, sigterm_timeout_s=1.0,
                           release_wait_s=0.2),
    goals=soak.Goals(min_requests=20),
)  # fmt: skip


class GrowingNvml(FakeNvml):
    """Memory used grows by 1 GiB at every reading."""

    def nvmlDeviceGetMemoryInfo(self, h: int) -> _Obj:
        self.calls += 1
        return _Obj(used=(30 + self.calls) * 2**30)


HOST_USED_BYTES = soak.host_used_bytes


@pytest.fixture(autouse=True)
def _steady_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake pins nothing; a fixed host reading keeps the other processes of this
    machine out of the flatness and release checks."""
    monkeypatch.setattr(soak, "host_used_bytes", lambda: 8 << 30)


def _runner(out: Path, nvml: Any = None, **kw: Any) -> soak.Runner:
    script = Path(os.environ["FAKE_VLLM_DIR"]).parent / "fake_vllm.py"  # test_replay's `fake`
    options: dict[str, Any] = dict(
        nvml=nvml, provenance=lambda: dict(PROV), echo=lambda _: None, health_poll_s=0.05,
        stop_timeout_s=1.0,
    )  # fmt: skip
    return soak.Runner(TINY, out, [sys.executable, str(script)], "m", SPEC, **{**options, **kw})


def _statuses(summary: dict[str, Any], arm: str) -> dict[str, str]:
    return {k: v["status"] for k, v in summary["arms"][arm]["checks"].items()}


@pytest.mark.usefixtures("fake")
def test_a_soak_of_the_pool_and_the_resident_arm_passes_what_it_measures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    written = _runner(out, FakeNvml()).run(["pool", "resident"])
    assert {p.name for p in written} >= {"soak-pool.json", "soak-resident.json"}
    assert all(results.validate(p) == [] for p in written)
    pool = json.loads((out / "soak-pool.json").read_text())["data"]
    assert pool["complete"] and pool["state"] == "ok"
    requests = pool["requests"]
    assert any(r["stream"] and r["dropped"] for r in requests)
    assert any(r["stream"] and not r["dropped"] and r["gaps_ms"] for r in requests)
    assert any(not r["stream"] for r in requests)
    assert [c["gpu_mib"] for c in pool["checkpoints"]] == [{"0": 30 * 1024.0, "1": 31 * 1024.0}] * 2
    host = pool["checkpoints"][0]["host"]
    assert len(host["processes"]) == 2 and host["rss_bytes"] > 0  # the fake and its child
    assert {b["kind"]: b["status"] for b in pool["bad_requests"]}["unknown-model"] == 404
    assert pool["shutdown"]["streaming_at_signal"] == 2
    assert not pool["shutdown"]["escalated_to_sigkill"]

    written = soak.write_summary(out)
    assert results.validate(written[0]) == []
    summary = json.loads(written[0].read_text())
    measured = dict.fromkeys(soak.CHECKS, soak.PASS)
    assert _statuses(summary, "pool") == measured
    assert _statuses(summary, "resident") == measured | {
        "route_error": soak.NOT_MEASURED, "greedy_equal": soak.NOT_MEASURED,
    }  # fmt: skip
    checks = summary["arms"]["pool"]["checks"]
    assert "VmLck and VmPin read 0" in checks["pinned_flat"]["detail"]
    latency = next(ln for ln in written[1].read_text().splitlines() if "churn latency" in ln)
    assert latency.count("time to first token") == 2 and "not measured" not in latency
    assert checks["greedy_equal"]["equal"] == [True, True]
    assert summary["not_measured"] == []
    assert "| requests answered during the churn" in written[1].read_text()
    # A later call with the same folder does not run a complete arm again.
    again = _runner(out, FakeNvml()).run(["pool", "resident"])
    assert [p.name for p in again if not p.name.startswith("plan-")] == []


@pytest.mark.usefixtures("fake")
def test_each_check_fails_where_the_server_misbehaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_SOAK", "bad-500,pool-differs,ignore-sigterm")
    out = tmp_path / "out"
    _runner(out, GrowingNvml(), stop_timeout_s=0.5).run(["pool", "resident"])
    summary = soak.summarize(out)
    pool = summary["arms"]["pool"]["checks"]
    failed = {k for k, v in pool.items() if v["status"] == soak.FAIL}
    assert failed == {"bad_requests", "gpu_memory_flat", "greedy_equal", "sigterm"}
    assert "oversized-logprobs: 500" in pool["bad_requests"]["detail"]
    assert pool["greedy_equal"]["equal"] == [False, False]
    assert "SIGKILL was needed" in pool["sigterm"]["detail"]
    assert "| **fail**:" in soak.summary_markdown(summary)


@pytest.mark.usefixtures("fake")
def test_an_arm_whose_server_does_not_start_is_a_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "crash")
    _runner(tmp_path).run(["pool"])
    checks = soak.summarize(tmp_path)["arms"]["pool"]["checks"]
    assert checks["startup"]["status"] == soak.FAIL
    assert "use --moe-expert-pool-rows <= 193" in checks["startup"]["detail"]
    assert {v["status"] for k, v in checks.items() if k != "startup"} == {soak.NOT_MEASURED}


def test_more_pinned_bytes_at_the_second_checkpoint_fail_the_flatness_check() -> None:
    def point(locked: int, rss: int) -> dict[str, Any]:
        host = {"rss_bytes": rss, "locked_bytes": locked, "pinned_bytes": 0}
        return {"gpu_mib": None, "host": host}

    goals = {"flat_within": 0.01}
    flat = soak._flat({"checkpoints": [point(100 << 30, 1 << 30), point(100 << 30, 2 << 30)]},
                      goals)  # fmt: skip
    assert flat["pinned_flat"]["status"] == soak.PASS
    assert "host RSS 1.00 -> 2.00 GiB (+100.00%)" in flat["pinned_flat"]["detail"]
    assert flat["gpu_memory_flat"]["status"] == soak.NOT_MEASURED
    grown = soak._flat({"checkpoints": [point(100 << 30, 1), point(102 << 30, 1)]}, goals)
    assert grown["pinned_flat"]["status"] == soak.FAIL
    # CUDA's pinned pages are not in VmLck/VmPin: host memory in use stands in for them.
    unaccounted = [{**point(0, 1), "host_used_bytes": used} for used in (40 << 30, 41 << 30)]
    proxy = soak._flat({"checkpoints": unaccounted}, goals)["pinned_flat"]
    assert proxy["status"] == soak.FAIL and "host memory in use" in proxy["detail"]
    unaccounted[1]["host_used_bytes"] = 40 << 30
    assert soak._flat({"checkpoints": unaccounted}, goals)["pinned_flat"]["status"] == soak.PASS
    unaccounted[1]["host_used_bytes"] = None
    assert soak._flat({"checkpoints": unaccounted}, goals)["pinned_flat"]["status"] == (
        soak.NOT_MEASURED
    )


def test_host_memory_kept_after_the_exit_fails_the_sigterm_check() -> None:
    goals = {"exit_within_s": 30, "gpu_released_within_mib": 1024,
             "host_released_within_mib": 2048}  # fmt: skip
    down = {"alive_at_signal": True, "exit_s": 3.0, "streaming_at_signal": 4, "in_flight": 4,
            "gpu_mib_after_exit": {"0": 600.0}, "host_used_after_exit": 12 << 30}  # fmt: skip
    data = {"shutdown": down, "gpu_mib_before_start": {"0": 500.0},
            "host_used_before_start": 11 << 30}  # fmt: skip
    assert soak._sigterm_check(data, goals)["status"] == soak.PASS
    down["host_used_after_exit"] = 40 << 30  # 29 GiB of pinned experts not given back
    kept = soak._sigterm_check(data, goals)
    assert kept["status"] == soak.FAIL and "+29696 MiB" in kept["detail"]


@pytest.mark.usefixtures("fake")
def test_start_up_faults_are_recorded_against_what_the_tree_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = ["rows-below-top-k", "rows-and-gb", "rows-above-experts", "dense-model",
             "non-nvfp4-moe", "host-ram-below-pool"]  # fmt: skip

    def no_cgroup(name: str, limit: int) -> Path:
        raise HarnessError("no cgroup v2 hierarchy at /sys/fs/cgroup")

    _runner(tmp_path / "ok", make_cgroup=no_cgroup).run([], names)
    faults = soak.summarize(tmp_path / "ok")["faults"]
    assert {n: f["check"]["status"] for n, f in faults.items()} == {
        "rows-below-top-k": soak.PASS, "rows-and-gb": soak.PASS,
        "rows-above-experts": soak.PASS, "dense-model": soak.PASS,
        "non-nvfp4-moe": soak.PASS, "host-ram-below-pool": soak.NOT_MEASURED,
    }  # fmt: skip
    below = faults["rows-below-top-k"]["observed"]
    assert below["outcome"] == "fails" and not below["weights_loaded"]
    assert "needs at least top_k=4 rows per layer" in below["message"]
    # The small models the run writes for itself, a dense one and an unquantized MoE, are
    # refused before they load.
    for name in ("dense-model", "non-nvfp4-moe"):
        seen = faults[name]["observed"]
        assert seen["outcome"] == "fails" and not seen["weights_loaded"], name
    assert (tmp_path / "ok/models/dense/config.json").exists()
    assert (tmp_path / "ok/models/bf16-moe/config.json").exists()
    # A host where no memory cgroup can be made says why the limit was not tried.
    host = faults["host-ram-below-pool"]
    assert host["observed"]["outcome"] == "not run"
    assert host["check"]["detail"] == "on this host: no cgroup v2 hierarchy at /sys/fs/cgroup"
    # A folder of faults only has no empty table of arm checks.
    table = soak.summary_markdown(soak.summarize(tmp_path / "ok"))
    assert "No arm was served in this folder" in table and "the server starts" not in table
    # A pool flag refused only after the weights loaded fails the check.
    monkeypatch.setenv("FAKE_VLLM_SOAK", "late-fault")
    _runner(tmp_path / "late").run([], ["rows-below-top-k"])
    late = soak.summarize(tmp_path / "late")["faults"]["rows-below-top-k"]
    assert late["check"]["status"] == soak.FAIL and late["observed"]["weights_loaded"]


@pytest.mark.usefixtures("fake")
def test_a_memory_limit_fault_runs_the_server_in_its_cgroup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fake `unshare` and `mount`: the wrapper's quoting and the cgroup.procs write are
    # real, the namespace is not made; `mount` writes down what it was asked to bind.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "unshare").write_text('#!/bin/sh\nshift\nFAKE_CGROUP=1 exec "$@"\n')
    (bin_dir / "mount").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "mounted"}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    made: dict[str, int] = {}

    def cgroup(name: str, limit: int) -> Path:
        made[name] = limit
        folder = tmp_path / "cgroup"
        folder.mkdir()
        return folder

    _runner(tmp_path / "out", make_cgroup=cgroup).run([], ["host-ram-below-pool"])
    fault = soak.summarize(tmp_path / "out")["faults"]["host-ram-below-pool"]
    assert fault["check"]["status"] == soak.PASS, fault["check"]
    assert made == {"host-ram-below-pool": expert_bytes(SPEC) // 2}
    record = json.loads((tmp_path / "out/fault-host-ram-below-pool.json").read_text())
    assert record["data"]["cgroup_memory_max"] == expert_bytes(SPEC) // 2
    # The server's shell joined the cgroup before it became the server, and its
    # /sys/fs/cgroup is the cgroup's folder.
    assert (tmp_path / "cgroup/cgroup.procs").read_text().strip().isdigit()
    assert (tmp_path / "mounted").read_text().split() == [
        "--bind",
        str(tmp_path / "cgroup"),
        "/sys/fs/cgroup",
    ]


def test_memory_cgroup_needs_the_memory_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(soak.shutil, "which", lambda name: f"/usr/bin/{name}")
    with pytest.raises(HarnessError, match="no cgroup v2 hierarchy"):
        soak.memory_cgroup("f", 1 << 30, root=tmp_path)
    (tmp_path / "cgroup.subtree_control").write_text("cpu io\n")
    with pytest.raises(HarnessError, match="memory controller is not enabled"):
        soak.memory_cgroup("f", 1 << 30, root=tmp_path)
    (tmp_path / "cgroup.subtree_control").write_text("cpu io memory\n")
    folder = soak.memory_cgroup("f", 1 << 30, root=tmp_path)
    assert folder == tmp_path / "harness-soak-f"
    assert (folder / "memory.max").read_text() == f"{1 << 30}\n"
    monkeypatch.setattr(soak.shutil, "which", lambda name: None)
    with pytest.raises(HarnessError, match="no unshare"):
        soak.memory_cgroup("f", 1 << 30, root=tmp_path)


@pytest.mark.usefixtures("fake")
def test_an_arm_that_does_not_fit_the_deadline_is_planned_and_not_measured(
    tmp_path: Path,
) -> None:
    runner = _runner(tmp_path)
    runner.deadline = runner.clock() + 60  # the e2e profile's startup floor is 0 s here
    runner.startups = [61.0]
    assert [p.name.split("-")[0] for p in runner.run(["pool"])] == ["plan"]
    assert soak.summarize(tmp_path)["not_measured"] == ["arm pool"]


def test_main_writes_the_summary_when_a_time_limit_cuts_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cut(self: soak.Runner, arms: list[str], faults: list[str]) -> list[Path]:
        raise KeyboardInterrupt  # what device_run's time limit sends

    for module, name, stub in [
        (soak.checkpoint_routed, "write", lambda *a, **k: None),
        (soak.replay, "load_nvml", lambda: None),
        (soak.replay, "server_provenance", lambda python, argv: lambda: dict(PROV)),
        (soak.Runner, "run", cut),
    ]:
        monkeypatch.setattr(module, name, stub)
    with pytest.raises(KeyboardInterrupt):
        soak.main("glm-shape-h200", tmp_path, python=Path("py"), deadline_s=100)
    assert json.loads((tmp_path / "summary.json").read_text())["arms"] == {}
    assert (tmp_path / "summary.md").exists()


def test_the_dry_run_prints_servers_churn_bad_requests_shutdown_and_faults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.__main__ import main

    assert main(["replay", "soak", "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    serves = [line for line in out.splitlines() if " serve " in line]
    assert len(serves) == 2 and "--moe-expert-pool-gb 8.859" in serves[0]
    assert "--moe-expert-pool-gb" not in serves[1]
    assert "# churn: 48 clients for 150 s" in out and "# shutdown: 4 streaming" in out
    assert all(f"#   {name} (" in out for name in soak.BAD_REQUESTS)
    assert '"max_tokens": 90113' in out  # past the profile's context of 90112
    assert main(["replay", "soak", "--dry-run", "--faults", "--churn-s", "60",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert all(f"## fault {name}:" in out for name in soak.FAULTS)
    assert "# churn" not in out
    assert "VLLM_WEIGHT_OFFLOADING_DISABLE_PIN_MEMORY=1 " in out
    assert "--moe-expert-pool-rows 7 " in out and "--moe-expert-pool-gb 37 " in out
    # The memory-limit fault's server runs in its cgroup, through the wrapper.
    assert "# in the memory cgroup /sys/fs/cgroup/harness-soak-host-ram-below-pool" in out
    assert 'sh -c \'echo $$ > "$1/cgroup.procs"' in out
    assert not list(tmp_path.iterdir())
    assert main(["replay", "soak", "--dry-run", "--faults", "nope", "--out", str(tmp_path)]) == 2
    with pytest.raises(soak.HarnessError, match="drop --arms"):
        soak.main("glm-shape-h200", tmp_path, python=Path("py"), arms=["pool"], faults=[])


def test_the_help_names_every_fault(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.__main__ import main

    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines at hyphens
    assert all(name in text for name in soak.FAULTS)


def test_profiles_load_and_bad_ones_are_refused(tmp_path: Path) -> None:
    profile = soak.load_profiles()["glm-shape-h200"]
    assert profile.arms == ("pool", "resident") and profile.max_model_len == 90112
    assert set(profile.faults) == set(soak.FAULTS)
    assert set(profile.bad_requests) == set(soak.BAD_REQUESTS)
    bad = tmp_path / "p.toml"
    text = soak.PROFILES.read_text()
    for edit, error in [
        (("clients =", "client ="), r"churn: unknown keys \['client'\]"),
        (("arms = [", "arms = ['uvm', "), "arm 'uvm' is not in e2e profile"),
        (("prompt_len = [16, 2048]", "prompt_len = [2048, 16]"), "churn.prompt_len must be"),
        (('e2e_profile = "glm-shape-h200"', 'e2e_profile = "x"'), "e2e_profile must be"),
    ]:
        assert edit[0] in text, edit
        bad.write_text(text.replace(*edit, 1))
        with pytest.raises(soak.HarnessError, match=error):
            soak.load_profiles(bad)


def test_log_errors_are_counted_per_phase(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    start = "INFO ready\n"
    serving = "(APIServer pid=1) ERROR 12-01 [x.py:1] boom\nTraceback (most recent call last)\n"
    log.write_text(start + serving + "INFO shutdown\n")
    marks = {"startup": len(start), "serving": len(start + serving), "shutdown": 10**6}
    counted = soak.log_errors(log, marks)
    assert counted["startup"] == {"tracebacks": 0, "error_lines": 0, "examples": []}
    assert counted["serving"]["tracebacks"] == 1 and counted["serving"]["error_lines"] == 1
    assert counted["shutdown"]["error_lines"] == 0


def test_error_messages_of_vllm_and_fastapi_bodies() -> None:
    assert soak.error_message('{"error": {"message": "bad", "code": 400}}') == "bad"
    assert soak.error_message('{"object": "error", "message": "worse"}') == "worse"
    assert soak.error_message('{"detail": [{"msg": "x"}]}') == "[{'msg': 'x'}]"
    assert soak.error_message('{"error": {}}') == ""
    assert soak.error_message("Internal Server Error") == "Internal Server Error"


def test_host_memory_in_use_is_total_less_available(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  131072000 kB\nMemFree: 1000 kB\nMemAvailable: 100000000 kB\n")
    assert HOST_USED_BYTES(meminfo) == 31072000 * 1024
    meminfo.write_text("MemTotal:  131072000 kB\n")
    assert HOST_USED_BYTES(meminfo) is None
    assert HOST_USED_BYTES(tmp_path / "missing") is None
