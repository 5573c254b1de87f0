"""scripts/routed_copy_probe.py: what it compares against, and its options (no GPU)."""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

from tests.conftest import load_script


def _probe() -> ModuleType:
    return load_script("routed_copy_probe")


def test_the_script_imports_without_torch_or_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("torch", "vllm"):
        monkeypatch.setitem(sys.modules, name, None)
    assert _probe().MODES == ("host_view", "routed", "staged")


def test_gains_compare_with_the_mode_the_series_runs() -> None:
    m = _probe()
    below = {"series_stages": False, "host_view_ms": 300.0, "routed_ms": 250.0, "staged_ms": 400.0}
    above = {**below, "series_stages": True, "staged_ms": 200.0}
    assert m.gains(below) == {"host_view_over_routed": 1.2, "series_over_routed": 1.2}
    assert m.gains(above) == {"host_view_over_routed": 1.2, "series_over_routed": 0.8}


def test_widths_must_be_partition_steps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _probe().main(["--out", "x", "--sizes", "8,64", "--decode-tokens", "8"])
    assert "must exceed --decode-tokens" in capsys.readouterr().err
