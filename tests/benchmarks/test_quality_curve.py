"""The data-scaling curve's arithmetic: the fitted line, the data it predicts, and reports merged into one curve."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality_curve  # noqa: E402


def _point(recipe, conversations, tokens, tau, held, ngram=(1.3, 1.4)):
    return {"recipe": recipe, "conversations": conversations, "trained_tokens": tokens, "steps": conversations,
            "tau_mtbench": tau, "tau_heldout": held, "tau_ngram_mtbench": ngram[0], "tau_ngram_heldout": ngram[1]}


def test_the_fit_is_the_line_through_points_on_it():
    fit = quality_curve.fit_log([(1e3, 1.0), (1e4, 1.1), (1e5, 1.2)])
    assert fit["slope_per_10x"] == pytest.approx(0.1)
    assert fit["intercept"] == pytest.approx(0.7)
    assert fit["residual"] == pytest.approx(0.0, abs=1e-12)
    assert quality_curve.tokens_for(fit, 1.5) == pytest.approx(1e8)
    assert quality_curve.fit_log([(1e3, 1.0)]) is None
    assert quality_curve.tokens_for(quality_curve.fit_log([(1e3, 1.1), (1e4, 1.0)]), 1.5) is None  # falling


def test_summarise_fits_each_recipe_over_its_own_points_in_size_order():
    points = [_point("muon", 64, 1e4, 1.1, 1.2), _point("base", 32, 1e3, 1.0, 1.0), _point("muon", 32, 1e3, 1.0, 1.1),
              _point("base", 64, 1e4, 1.0, 1.05)]
    curves = quality_curve.summarise(points)
    assert list(curves) == ["muon", "base"]
    assert [p["conversations"] for p in curves["muon"]["points"]] == [32, 64]
    assert curves["muon"]["fits"]["mtbench"]["slope_per_10x"] == pytest.approx(0.1)
    assert curves["base"]["fits"]["mtbench"]["slope_per_10x"] == pytest.approx(0.0)
    # 2x n-gram (2.6) on a line 0.7 + 0.1 log10(tokens): 10^19 tokens; a flat line predicts nothing
    assert math.log10(curves["muon"]["trained_tokens_for"]["mtbench_2x_ngram"]) == pytest.approx(19.0)
    assert curves["base"]["trained_tokens_for"]["mtbench_2x_ngram"] is None
    assert "fits_local" not in curves["muon"]  # two points: the whole curve is its own local line


def test_the_local_line_follows_the_largest_sizes_where_the_curve_bends():
    # flat over the small sizes, then 0.2 per 10x: the whole-curve line is shallower than the local one
    taus = {1e3: 1.0, 1e4: 1.0, 1e5: 1.1, 1e6: 1.3, 1e7: 1.5}
    curves = quality_curve.summarise([_point("muon", int(t), t, tau, tau) for t, tau in taus.items()])
    local = curves["muon"]["fits_local"]["mtbench"]
    assert local["slope_per_10x"] == pytest.approx(0.2)
    assert curves["muon"]["fits"]["mtbench"]["slope_per_10x"] < 0.15
    # n-gram's τ 1.3 is the point at 10^6; 1.5x (1.95) is 3.25 decades on along the local line
    assert curves["muon"]["trained_tokens_for_local"]["mtbench_1x_ngram"] == pytest.approx(1e6)
    assert math.log10(curves["muon"]["trained_tokens_for_local"]["mtbench_1.5x_ngram"]) == pytest.approx(9.25)


def test_later_reports_replace_a_point_and_add_sizes(tmp_path):
    earlier = {"curves": {"muon": {"points": [_point("muon", 32, 1e3, 1.0, 1.1), _point("muon", 64, 1e4, 1.05, 1.1)]}}}
    later = {"metric": "quality_curve", "curves": {"muon": {"points": [
        _point("muon", 64, 1e4, 1.1, 1.2), _point("muon", 128, 1e5, 1.2, 1.3)]}}}
    merged = quality_curve.merge([earlier, later])
    assert sorted((p["conversations"], p["tau_mtbench"]) for p in merged) == [(32, 1.0), (64, 1.1), (128, 1.2)]

    first, second = tmp_path / "earlier.json", tmp_path / "run.log"
    first.write_text(json.dumps(earlier, indent=1))  # a published curve: the whole file
    second.write_text("progress lines first\n" + json.dumps(later) + "\nexit 0\n")  # a run's output: its report line
    out, picture = tmp_path / "curve.json", tmp_path / "curve.png"
    subprocess.run([sys.executable, str(Path(quality_curve.__file__)), str(first), str(second), "--json", str(out),
                    "--plot", str(picture)], check=True, capture_output=True)
    published = json.loads(out.read_text())["curves"]["muon"]
    assert [p["tau_mtbench"] for p in published["points"]] == [1.0, 1.1, 1.2]
    assert published["fits"]["mtbench"]["slope_per_10x"] == pytest.approx(0.1)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
