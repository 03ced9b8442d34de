"""torchtune_dtf.plan: block influence against Hugging Face's hidden states, the placement rule, the FLOP target,
the shipped planned configs reproduced from their command, and clear errors."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.test_recipe import load_config, run_recipe, train_assets, workdir  # noqa: F401  (fixtures)
from torchtune_dtf import closed_form
from torchtune_dtf.modules.layers import DroppedLayer, STTLayer
from torchtune_dtf.plan import block_influence, inner_layers_by_influence, main, plan_layers, planned_config_text

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "configs" / "quickstart"
#: The frontier study's measurement on the quickstart model's training text (experiments/frontier/block_influence.json).
STUDY_RANKING = json.loads((REPO / "experiments/frontier/block_influence.json").read_text())["inner_layers_by_influence"]


def test_block_influence_equals_one_minus_cosine_of_hugging_face_hidden_states(workdir):
    from transformers import Qwen2ForCausalLM

    from torchtune_dtf.evaluation.routing_report import load_trained
    from torchtune_dtf.models.model_config import dense_model_config

    cfg = load_config("stt_train")
    OmegaConf.update(cfg, "model", dense_model_config(OmegaConf.to_container(cfg.model)), merge=False)
    ours = load_trained(cfg, workdir / "tiny_qwen2_5_hf")
    windows = torch.randint(0, 151936, (3, 24), generator=torch.Generator().manual_seed(0))
    influence = block_influence(ours, windows, batch_size=2)

    reference = Qwen2ForCausalLM.from_pretrained(workdir / "tiny_qwen2_5_hf").eval()
    with torch.no_grad():
        hidden = reference(windows, output_hidden_states=True).hidden_states  # [embeddings, layer 0 out, …]
    # Hugging Face's last entry is after the final norm, so the reference covers every layer but the last.
    expected = [(1 - torch.cosine_similarity(hidden[i], hidden[i + 1], dim=-1)).mean().item() for i in range(3)]
    assert influence[:3] == pytest.approx(expected, abs=1e-5)
    assert len(set(round(v, 6) for v in influence)) == 4  # four different values: a ranking, not ties


def _quickstart_section(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(QUICKSTART / name).model, resolve=True)


def test_the_rule_drops_the_least_influential_and_routes_the_next():
    assert inner_layers_by_influence([0.9, 0.3, 0.1, 0.2, 0.1, 0.8]) == [2, 4, 3, 1]  # never layer 0 or 5; ties by index
    section = _quickstart_section("stt_smollm2.yaml")
    plan = plan_layers(section, STUDY_RANKING, seq_len=256, drop=5, route=6, capacity=0.5)
    assert plan.dropped_layers == [14, 13, 17, 15, 12] and plan.routed_layers == [16, 25, 26, 11, 18, 2]
    assert plan.model_values() == {"dropped_layers": [14, 13, 17, 15, 12], "routed_layers": [16, 25, 26, 11, 18, 2],
                                   "capacity": 0.5}
    shape = closed_form.model_shape_from_config(section)
    routing = closed_form.routing_shape_from_model_config({**section, **plan.model_values()}, 30, 576)
    assert plan.flop_ratio == pytest.approx(closed_form.flop_ratio(shape, routing, 256))


def test_a_flop_target_routes_the_fewest_layers_that_reach_it():
    section = _quickstart_section("stt_smollm2.yaml")
    plan = plan_layers(section, STUDY_RANKING, seq_len=256, drop=5, capacity=0.5, target_flops=0.85)
    assert plan.flop_ratio <= 0.85
    one_fewer = plan_layers(section, STUDY_RANKING, seq_len=256, drop=5, capacity=0.5, route=len(plan.routed_layers) - 1)
    assert one_fewer.flop_ratio > 0.85
    # Layer dropping alone: the target sets the number of dropped layers.
    layerdrop = _quickstart_section("layerdrop_smollm2.yaml")
    dropped = plan_layers(layerdrop, STUDY_RANKING, seq_len=256, target_flops=0.81)
    assert dropped.flop_ratio <= 0.81 < plan_layers(layerdrop, STUDY_RANKING, seq_len=256, drop=len(dropped.dropped_layers) - 1).flop_ratio
    assert dropped.dropped_layers == STUDY_RANKING[: len(dropped.dropped_layers)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(drop=5, route=6), "needs --drop .* and --capacity"),
    (dict(drop=5, capacity=0.5), "exactly one of --route"),
    (dict(drop=5, capacity=0.5, route=6, target_flops=0.8), "exactly one of --route"),
    (dict(drop=5, capacity=0.5, target_flops=0.3), "routing every remaining inner layer gives"),
    (dict(drop=8, capacity=0.5, target_flops=0.85), "dropping 8 layers alone gives"),
    (dict(drop=28, capacity=0.5, route=1), "28 inner layers"),
])
def test_a_plan_that_cannot_be_made_says_why(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_layers(_quickstart_section("stt_smollm2.yaml"), STUDY_RANKING, seq_len=256, **kwargs)


def _written_config_flop_ratio(text: str, seq_len: int) -> float:
    """The closed form's forward FLOP ratio of a config's text (the written file, read back as the recipe reads it)."""
    return closed_form.model_config_flop_ratio(OmegaConf.to_container(OmegaConf.create(text).model, resolve=True), seq_len)


def test_a_per_layer_capacity_plan_is_the_closed_form_of_the_config_it_writes():
    """One γ per routed layer, in ranking order: the plan's FLOP ratio is the closed form's of the written config,
    which pairs the list with routed_layers in the order it lists them."""
    section = _quickstart_section("stt_smollm2.yaml")
    graded = [0.25] * 4 + [0.75] * 4  # the frontier study's stt_bi8_graded: less γ where block influence is lower
    plan = plan_layers(section, STUDY_RANKING, seq_len=256, drop=0, route=8, capacity=graded)
    assert plan.routed_layers == STUDY_RANKING[:8] and plan.capacity == graded
    assert plan.model_values() == {"dropped_layers": [], "routed_layers": STUDY_RANKING[:8], "capacity": graded}
    written = planned_config_text((QUICKSTART / "stt_smollm2.yaml").read_text(), plan, "planned here")
    assert list(OmegaConf.create(written).model.capacity) == graded
    assert plan.flop_ratio == pytest.approx(_written_config_flop_ratio(written, 256), rel=1e-12)
    routing = closed_form.routing_shape_from_model_config({**section, **plan.model_values()}, 30, 576)
    assert routing.gamma_of() == dict(zip(STUDY_RANKING[:8], graded))  # each layer keeps its own γ
    # without skipped tokens' K/V, attention among the executed tokens grows as k²: not the ratio of one γ at the mean
    assert plan.flop_ratio > plan_layers(section, STUDY_RANKING, seq_len=256, drop=0, route=8, capacity=0.5).flop_ratio
    # with them (the study's `all`), the frontier study's number for that shape (oracle_probe.md: 0.903)
    kv = {**section, "skipped_tokens_write_kv": True}
    assert plan_layers(kv, STUDY_RANKING, seq_len=256, drop=0, route=8, capacity=graded).flop_ratio == \
        pytest.approx(0.903, abs=5e-4)
    # one γ in a list of one, or the same γ per layer, is the one-γ plan's ratio
    uniform = plan_layers(section, STUDY_RANKING, seq_len=256, drop=5, route=6, capacity=0.5)
    assert plan_layers(section, STUDY_RANKING, seq_len=256, drop=5, route=6, capacity=[0.5]) == uniform
    assert plan_layers(section, STUDY_RANKING, seq_len=256, drop=5, route=6, capacity=[0.5] * 6).flop_ratio == \
        pytest.approx(uniform.flop_ratio, rel=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(drop=2, route=5, capacity=[0.25, 0.75]),
     r"--capacity lists 2 values but --route 5 routes 5 layers: give one γ, or one per routed layer"),
    (dict(drop=0, route=2, capacity=[0.25, 0.5, 0.75]), r"--capacity lists 3 values but --route 2"),
    (dict(drop=2, capacity=[0.25, 0.75], target_flops=0.9),
     r"--capacity lists 2 values, one per routed layer: give --route 2, not --target-flops"),
    (dict(drop=2, route=2, capacity=[]), r"--capacity lists no value"),
])
def test_a_per_layer_capacity_of_another_length_than_the_routed_layers_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_layers(_quickstart_section("stt_smollm2.yaml"), STUDY_RANKING, seq_len=256, **kwargs)


def test_the_command_line_takes_one_capacity_per_routed_layer(tmp_path, monkeypatch, capsys):
    """``--capacity`` with several values: written as a list in ranking order (measurement stubbed: the tiny model's
    inner layers rank 2, 1)."""
    import torchtune_dtf.plan as plan_module

    monkeypatch.setattr(plan_module, "_measure", lambda cfg, data, windows, seq_len: [1.0, 0.2, 0.1, 1.0])
    config = REPO / "configs/tiny/stt_train.yaml"
    plan = main(["--config", str(config), "--data", str(tmp_path / "unread.jsonl"), "--drop", "0", "--route", "2",
                 "--capacity", "0.25", "0.75", "--write", str(tmp_path / "planned.yaml")])
    assert plan.routed_layers == [2, 1] and plan.capacity == [0.25, 0.75]
    written = (tmp_path / "planned.yaml").read_text()
    model = OmegaConf.create(written).model
    assert list(model.routed_layers) == [2, 1] and list(model.capacity) == [0.25, 0.75]
    assert written.splitlines()[0].endswith("--capacity 0.25 0.75 --write " + str(tmp_path / "planned.yaml"))
    assert plan.flop_ratio == pytest.approx(_written_config_flop_ratio(written, 48), rel=1e-12)
    assert 'model.capacity=[0.25, 0.75]' in capsys.readouterr().out
    # one value is one γ, as before
    assert main(["--config", str(config), "--data", str(tmp_path / "unread.jsonl"), "--drop", "0", "--route", "2",
                 "--capacity", "0.5"]).capacity == 0.5
    with pytest.raises(ValueError, match="--capacity lists 3 values but --route 2"):
        main(["--config", str(config), "--data", str(tmp_path / "unread.jsonl"), "--drop", "0", "--route", "2",
              "--capacity", "0.25", "0.5", "0.75"])


def test_the_planned_config_keeps_every_other_line():
    text = (QUICKSTART / "stt_smollm2.yaml").read_text()
    plan = plan_layers(_quickstart_section("stt_smollm2.yaml"), STUDY_RANKING, seq_len=256, drop=4, route=2, capacity=0.625)
    planned = planned_config_text(text, plan, "planned here")
    changed = [(a, b) for a, b in zip(text.splitlines(), planned.splitlines()) if a != b]
    assert len(changed) == 3 and len(planned.splitlines()) == len(text.splitlines())
    model = OmegaConf.create(planned).model
    assert list(model.dropped_layers) == [14, 13, 17, 15] and list(model.routed_layers) == [12, 16] and model.capacity == 0.625
    with pytest.raises(ValueError, match="no line for capacity"):
        planned_config_text(text.replace("  capacity: 0.5\n", ""), plan, "x")


def test_the_shipped_tiny_planned_config_is_the_planner_output(workdir, capsys):
    """configs/tiny/stt_planned_train.yaml is what its header's command writes on the tiny checkpoint, and trains."""
    shipped = REPO / "configs" / "tiny" / "stt_planned_train.yaml"
    plan = main(["--config", str(REPO / "configs/tiny/stt_train.yaml"), "--drop", "1", "--route", "1",
                 "--capacity", "0.5", "--write", str(workdir / "planned.yaml"), "--json", str(workdir / "plan.json")])
    assert (workdir / "planned.yaml").read_text().split("\n", 1)[1] == shipped.read_text().split("\n", 1)[1]
    measured = json.loads((workdir / "plan.json").read_text())
    assert plan.dropped_layers == measured["inner_layers_by_influence"][:1]
    assert "forward FLOPs / dense at T = 48" in capsys.readouterr().out
    cfg = load_config("stt_planned_train", max_steps_per_epoch=2)
    recipe = run_recipe(cfg)
    assert isinstance(recipe._model.layers[plan.dropped_layers[0]], DroppedLayer)
    assert isinstance(recipe._model.layers[plan.routed_layers[0]], STTLayer)
