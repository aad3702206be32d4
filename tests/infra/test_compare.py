"""The main job end to end, small: the sweep, the table, the figures, the executed analysis notebook."""

import subprocess
import sys

import pandas as pd

from kvlab.schema import DESIGNS


def test_compare_writes_results_figures_and_the_executed_analysis(tmp_path):
    out = tmp_path / "compare"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlab",
            "compare",
            "--device",
            "cpu",
            "--preset",
            "toy",
            "--new",
            "16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = pd.read_csv(out / "results.csv")
    assert len(results) == len(DESIGNS) and set(results["status"]) == {"ok"}
    assert set(zip(results["cache"], results["loop"])) == set(DESIGNS)
    assert (results["prediction_error"].abs() <= 0.05).all()
    for name in ("compare.png", "03_analysis.ipynb"):
        assert (out / name).stat().st_size > 0
        assert str(out / name) in result.stdout
    assert "tuple / v4.40 (<= 4.41) over the best v5 design's overhead" in result.stdout


def test_the_analysis_takes_a_catalogue_preset(tmp_path):
    """Notebook 03 imports the lessons' presets alone; compare's analysis also builds the catalogue's (cuda-default's
    TinyLlama). The lesson's measured table, its preset renamed to a catalogue twin: the analysis builds its config."""
    from kvlab.compare import analyse

    table = pd.read_csv("data/cpu/results.csv").assign(preset="qwen3-8b-twin")
    table.to_csv(tmp_path / "results.csv", index=False)
    analysis = analyse(tmp_path / "results.csv")  # papermill raises where a cell fails
    assert "saving against new tokens" in analysis.read_text()  # the improvement table: each row's config built
