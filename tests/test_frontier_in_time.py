"""experiments/frontier_in_time.py: a study's losses against measured time, and each recipe's verdict against the
layer-dropping line at its own cost, on a made-up study and benchmark file with known answers."""

import json

import pytest

from experiments import frontier_in_time as fit
from benchmarks.compiled import SMOLLM2_RECIPES

RUN = {label: name for label, _, name in SMOLLM2_RECIPES}


def _study(tmp_path, losses, flops=None):
    runs = tmp_path / "study" / "runs"
    runs.mkdir(parents=True)
    for label, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            (runs / f"{RUN[label]}__seed{seed}.json").write_text(json.dumps(
                {"name": RUN[label], "seed": seed, "heldout": {"student_loss": loss},
                 "compute": {"forward_flops_ratio": (flops or {}).get(label)}}))
    return tmp_path / "study"


def _timing(tmp_path, ratios):
    """Three rounds per model, dense 1.0 s; each model's rounds at ``ratio`` × dense."""
    sections = {w: {"times": {label: [r[w] * 1.0] * 3 for label, r in ratios.items()}} for w in ("prefill", "decode_b1")}
    timing = {"shape": "smollm2", "models": list(ratios), "sections": {"eager": sections}, "rounds": 3,
              "command": "python -m benchmarks.compiled (made up)", "date": "2026-12-05", "device": "CPU"}
    path = tmp_path / "timing.json"
    path.write_text(json.dumps(timing))
    return path


def test_line_interpolates_between_neighbours_and_refuses_outside():
    points = [(0.9, 4.4), (0.7, 4.6), (0.8, 4.5)]
    assert fit.line_at(points, 0.85) == pytest.approx(4.45)
    assert fit.line_at(points, 0.7) == pytest.approx(4.6)
    assert fit.line_at(points, 0.95) is None and fit.line_at(points, 0.6) is None


def test_verdict_is_the_recipe_minus_layer_dropping_at_the_recipes_own_cost(tmp_path):
    ratios = {"dense": {"prefill": 1.0, "decode_b1": 1.0},
              "layerdrop_4": {"prefill": 0.9, "decode_b1": 0.9},
              "layerdrop_7": {"prefill": 0.7, "decode_b1": 0.7},
              # the study's FLOPs 0.8 (the line's 4.5 there), prefill 0.8, decode 0.88 (slower: the line's 4.42 there)
              "hybrid_0.81": {"prefill": 0.8, "decode_b1": 0.88}}
    flops = {"dense": 1.0, "layerdrop_4": 0.9, "layerdrop_7": 0.7, "hybrid_0.81": 0.8}
    study = _study(tmp_path, {"dense": [4.3, 4.3], "layerdrop_4": [4.39, 4.41], "layerdrop_7": [4.6],
                              "hybrid_0.81": [4.45, 4.47, 4.46]}, flops)
    result = fit.main(["--study", str(study), "--timing", str(_timing(tmp_path, ratios))])
    got = {row["cost"]: row for row in result["verdicts"] if row["recipe"] == "hybrid_0.81"}
    assert got["flops"]["line"] == pytest.approx(4.5) and got["flops"]["difference"] == pytest.approx(-0.04)
    assert got["prefill"]["difference"] == pytest.approx(-0.04)
    # In decode time the same model sits where the line is better: the verdict flips sign.
    assert got["decode_b1"]["line"] == pytest.approx(4.42) and got["decode_b1"]["difference"] == pytest.approx(0.04)
    page = (study / "time_frontier.md").read_text()
    assert "| hybrid_0.81 | decode_b1 | 0.880 | 4.460 | 4.420 | +0.040 |" in page
    assert "| hybrid_0.81 | `stt_d5_bi6_all_nocurr_fixedcrit_bias_rlr10` | 3 |" in page
    assert (study / "time_frontier.png").stat().st_size > 0


def test_a_timing_file_of_another_shape_is_refused(tmp_path):
    path = _timing(tmp_path, {"dense": {"prefill": 1.0, "decode_b1": 1.0}})
    timing = json.loads(path.read_text())
    timing["shape"] = "0_5b"
    path.write_text(json.dumps(timing))
    with pytest.raises(ValueError, match="times the '0_5b' shape"):
        fit.main(["--study", str(_study(tmp_path, {"dense": [4.3]})), "--timing", str(path)])


def test_dense_closes_the_line_at_its_costly_end():
    costs = {"dense": {"decode_b1": 1.0}, "layerdrop_4": {"decode_b1": 0.9}, "hybrid_0.90": {"decode_b1": 0.95}}
    losses = {"dense": 4.3, "layerdrop_4": 4.4, "hybrid_0.90": 4.36}
    (row,) = fit.verdicts(costs, losses)
    assert row["line"] == pytest.approx(4.35) and row["difference"] == pytest.approx(0.01)
