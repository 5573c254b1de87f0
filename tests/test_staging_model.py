"""scripts/staging_pipeline_model.py: the pipeline arithmetic, and the committed model files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "staging_pipeline_model.py"


def _model() -> ModuleType:
    return load_script("staging_pipeline_model")


def test_copy_bound_layers_take_the_sum_of_the_copies() -> None:
    m = _model()
    copy, bank, staged = [3.0, 3.0, 3.0], [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
    # Copies back to back; the last staged pass follows the last copy.
    assert m.double_buffer_s(copy, bank, staged) == pytest.approx(9.5)
    assert m.in_order_s(copy, bank, staged) == pytest.approx(9.5)


def test_compute_bound_layers_hide_all_but_the_first_copy() -> None:
    m = _model()
    copy, bank, staged = [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]
    # The first copy overlaps the first bank pass; then compute alone.
    assert m.double_buffer_s(copy, bank, staged) == pytest.approx(9.0)
    assert m.in_order_s(copy, bank, staged) == pytest.approx(9.0)


def test_copy_heavy_early_layers_cost_more_than_the_goal_bound() -> None:
    m = _model()
    copy = [4.0, 4.0, 0.0, 0.0]
    bank, staged = [1.0] * 4, [1.0] * 4
    floor = m.in_order_s(copy, bank, staged)
    # max(sum of compute, sum of copies) is 8; in layer order the copies of
    # the first two layers come before their staged passes.
    assert floor == pytest.approx(13.0)
    assert m.double_buffer_s(copy, bank, staged) >= floor


@pytest.mark.parametrize("run", ["run2", "run3"])
def test_committed_model_files_follow_from_their_runs(run: str, tmp_path: Path) -> None:
    folder = ROOT / "results" / "staging"
    source = folder / f"staging_replay_{run}.json"
    committed = json.loads((folder / f"pipeline_model_{run}.json").read_text())
    out = tmp_path / "model.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(source), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["data"] == committed["data"]
    assert committed["provenance"]["derived_from"] == f"results/staging/staging_replay_{run}.json"
