"""experiments/frontier_in_time.py: a study's losses against measured time, and each recipe's verdict against the
layer-dropping line at its own cost, on a made-up study and benchmark file with known answers."""

import json

import pytest

from experiments import frontier_in_time as fit
from benchmarks.compiled import SMOLLM2_RECIPES

RUN = {label: name for label, _, name in SMOLLM2_RECIPES}


def _study(tmp_path, losses, flops=None, test_losses=None):
    """Run JSONs with the held-out (validation) losses ``losses`` and, where given, test-window losses."""
    runs = tmp_path / "study" / "runs"
    runs.mkdir(parents=True)
    for label, per_seed in losses.items():
        for seed, loss in enumerate(per_seed):
            result = {"name": RUN[label], "seed": seed, "heldout": {"student_loss": loss},
                      "compute": {"forward_flops_ratio": (flops or {}).get(label)}}
            if test_losses and label in test_losses and seed < len(test_losses[label]):
                result["test"] = {"student_loss": test_losses[label][seed]}
            (runs / f"{RUN[label]}__seed{seed}.json").write_text(json.dumps(result))
    return tmp_path / "study"


def _timing(tmp_path, ratios, mode="eager", workloads=("prefill", "decode_b1"), name="timing"):
    """Three rounds per model, dense 1.0 s; each model's rounds at ``ratio`` × dense."""
    sections = {w: {"times": {label: [r[w] * 1.0] * 3 for label, r in ratios.items()}} for w in workloads}
    timing = {"shape": "smollm2", "models": list(ratios), "sections": {mode: sections}, "rounds": 3,
              "command": f"python -m benchmarks.compiled ({name})", "date": "2026-12-05", "device": "CPU"}
    path = tmp_path / f"{name}.json"
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


def test_test_window_losses_and_a_compiled_timing_make_their_own_page(tmp_path):
    """``--loss test`` reads each run's test-window loss (a seed without one is not counted), ``--mode compiled`` the
    compiled section, and the page is named for both so the default (eager, held-out) page is left as it is."""
    ratios = {"dense": {"prefill": 1.0, "decode_b1": 1.0},
              "layerdrop_4": {"prefill": 0.9, "decode_b1": 0.9},
              "layerdrop_7": {"prefill": 0.7, "decode_b1": 0.7},
              "hybrid_0.81": {"prefill": 0.8, "decode_b1": 0.75}}
    # Held-out losses would put the recipe above the line; the test losses put it 0.06 below at decode 0.75.
    study = _study(tmp_path, {"dense": [4.3], "layerdrop_4": [4.4], "layerdrop_7": [4.6], "hybrid_0.81": [4.9, 4.9]},
                   test_losses={"dense": [3.3], "layerdrop_4": [3.4], "layerdrop_7": [3.6], "hybrid_0.81": [3.49]})
    (study / "time_frontier.md").write_text("the eager page\n")
    timing = _timing(tmp_path, ratios, mode="compiled")
    result = fit.main(["--study", str(study), "--timing", str(timing), "--mode", "compiled", "--loss", "test"])
    assert result["losses"]["hybrid_0.81"] == pytest.approx(3.49)  # one seed has a test loss, one does not
    (row,) = [r for r in result["verdicts"] if r["recipe"] == "hybrid_0.81" and r["cost"] == "decode_b1"]
    assert row["line"] == pytest.approx(3.55) and row["difference"] == pytest.approx(-0.06)
    page = (study / "time_frontier_compiled_test.md").read_text()
    assert "--mode compiled --loss test" in page and "test windows" in page
    assert "| hybrid_0.81 | `stt_d5_bi6_all_nocurr_fixedcrit_bias_rlr10` | 1 | 3.490 |" in page
    assert (study / "time_frontier_compiled_test.png").stat().st_size > 0
    assert (study / "time_frontier.md").read_text() == "the eager page\n"
    # Asking for the eager section of a compiled-only timing names what the file has.
    with pytest.raises(ValueError, match=r"no eager section \(it has \['compiled'\]\)"):
        fit.main(["--study", str(study), "--timing", str(timing)])


def test_a_later_timing_file_supplies_the_workloads_it_times(tmp_path):
    """A prefill re-timed in a process of its own replaces the first file's prefill whole (the line and the recipe
    from the same run); the decode stays the first file's; the page names which command timed which workload."""
    first = {"dense": {"prefill": 1.0, "decode_b1": 1.0}, "layerdrop_4": {"prefill": 0.9, "decode_b1": 0.9},
             "layerdrop_7": {"prefill": 0.7, "decode_b1": 0.7}, "hybrid_0.81": {"prefill": 0.95, "decode_b1": 0.8}}
    again = {"dense": {"prefill": 1.0}, "layerdrop_4": {"prefill": 0.88}, "layerdrop_7": {"prefill": 0.72},
             "hybrid_0.81": {"prefill": 0.8}}
    study = _study(tmp_path, {"dense": [4.3], "layerdrop_4": [4.4], "layerdrop_7": [4.6], "hybrid_0.81": [4.45]})
    result = fit.main(["--study", str(study), "--timing", str(_timing(tmp_path, first, name="both")),
                       str(_timing(tmp_path, again, workloads=("prefill",), name="prefill_again"))])
    assert result["costs"]["hybrid_0.81"]["prefill"] == pytest.approx(0.8)
    assert result["costs"]["layerdrop_4"]["prefill"] == pytest.approx(0.88)
    assert result["costs"]["hybrid_0.81"]["decode_b1"] == pytest.approx(0.8)
    (row,) = [r for r in result["verdicts"] if r["recipe"] == "hybrid_0.81" and r["cost"] == "prefill"]
    assert row["line"] == pytest.approx(4.5)  # between (0.72, 4.6) and (0.88, 4.4)
    page = result["page"].read_text()
    assert "decode_b1: `python -m benchmarks.compiled (both)`" in page
    assert "prefill: `python -m benchmarks.compiled (prefill_again)`" in page


def test_a_study_without_the_asked_loss_is_refused(tmp_path):
    study = _study(tmp_path, {"dense": [4.3], "layerdrop_4": [4.4]})
    timing = _timing(tmp_path, {"dense": {"prefill": 1.0, "decode_b1": 1.0}, "layerdrop_4": {"prefill": 0.9,
                                                                                              "decode_b1": 0.9}})
    with pytest.raises(ValueError, match="no test student loss for any timed run"):
        fit.main(["--study", str(study), "--timing", str(timing), "--loss", "test"])


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
