"""scripts/make_plots.py draws its three PNGs from the committed result files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_plots_are_drawn_from_the_result_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the harness nox session installs matplotlib")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_plots.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["b12x_memory_by_layer.png", "marlin_bound.png", "ttft_by_staging_mode.png"]
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
