"""experiments/frontier/trained_probe.py: the trained run, rebuilt on the dense model with its learned skip biases,
is the routed model wherever the choice of tokens cannot matter; its shape is read from the run's config."""

import math
from pathlib import Path

import torch
from omegaconf import OmegaConf

from tests.conftest import load_script
from tests.test_recipe import load_config, run_recipe, train_assets, workdir  # noqa: F401  (fixtures)
from torchtune_dtf.evaluation.routing_report import load_trained

PROBE_PY = Path(__file__).resolve().parents[1] / "experiments" / "frontier" / "trained_probe.py"


def load_probe():
    return load_script(PROBE_PY, "trained_probe")


def test_at_full_capacity_every_choice_is_the_trained_routed_model_with_its_dropped_layers_skip_bias(workdir):  # noqa: F811
    probe = load_probe()
    cfg = load_config("stt_train", **{
        "model.routed_layers": [1, 3], "model.dropped_layers": [2], "model.capacity": 1.0,
        "model.skip_update": "bias", "model.skipped_tokens_write_kv": True, "max_steps_per_epoch": 2,
        "learning_rates.routers": 0.1})  # the skip bias learns with the routers: large enough to matter here
    run_recipe(cfg)
    run_dir = workdir / "outputs"
    shape = probe.trained_shape(OmegaConf.load(run_dir / "torchtune_config.yaml").model)  # as the recipe saved it
    assert (shape.dropped, shape.routed, list(shape.capacity)) == ((2,), (1, 3), [1.0, 1.0])

    dense = load_trained(load_config("dense_train"), "tiny_qwen2_5_hf")
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = probe.probe_run(run_dir, dense, tokens, beta=100.0, batch_size=2)
    assert set(loss) == set(probe.CHOICES)
    # every token runs every routed layer: the teacher, hindsight, random and "routed layers dense" are one model,
    # rebuilt from the dense keys and the dropped layer's learned constant update
    for choice in ("oracle", "random", "routed layers dense"):
        assert math.isclose(loss[choice], loss["teacher"], rel_tol=1e-5), choice
    # the learned skip bias of the dropped layer is part of that model
    assert abs(loss["oracle, no skip bias"] - loss["oracle"]) > 1e-4

    # the page: one row per choice, mean ± std over the runs and the difference to the student per run
    shifted = {choice: value + 0.5 for choice, value in loss.items()}
    page = probe.markdown_page({"windows": 2, "seq_len": 16, "text": "t.jsonl", "beta": 100.0,
                                "runs": [{"run": "a", "loss": loss}, {"run": "b", "loss": shifted}]})
    rows = {line.split(" | ")[0].lstrip("| "): line for line in page.splitlines() if line.startswith("| ")}
    assert set(probe.CHOICES) <= set(rows) and "`a`, `b`" in page
    gap = loss["random"] - loss["student"]
    assert f"| {loss['random'] + 0.25:.3f} ± 0.354 | {gap:.3f} ± 0.000 |" in rows["random"]
