"""experiments/frontier/oracle_probe.py: a shape that runs every token is the dense model, a dropped layer is
layer dropping, and the oracle runs the tokens of largest update (not the first ones)."""

import json
import math
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.conftest import VOCAB, build_tiny, load_script
from tests.test_recipe import load_config, train_assets, workdir  # noqa: F401  (fixtures)
from torchtune_dtf.evaluation.routing_report import load_trained

PROBE_PY = Path(__file__).resolve().parents[1] / "experiments" / "frontier" / "oracle_probe.py"


def load_probe():
    return load_script(PROBE_PY, "oracle_probe")


def model_loss(model, windows):
    with torch.no_grad():
        logits = model(windows).float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item()


def windows():
    return torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))


def test_every_token_routed_is_the_dense_model_with_and_without_skipped_tokens_kv():
    probe, dense, tokens = load_probe(), build_tiny("dense"), windows()
    reference = model_loss(dense, tokens)
    for write_kv in (True, False):
        shape = probe.Shape("all", routed=(0, 1, 2, 3), capacity=[1.0] * 4, skipped_tokens_write_kv=write_kv)
        for selection in probe.SELECTIONS:
            got = probe.shape_loss(dense, tokens, shape, selection, batch_size=2, seed=0)
            assert math.isclose(got["loss"], reference, rel_tol=1e-5), (write_kv, selection)
            assert got["executed_share_of_routed_and_dropped"] == 1.0


def test_dropped_layers_are_the_layer_dropping_variant_and_routing_half_changes_the_loss():
    probe, dense, tokens = load_probe(), build_tiny("dense"), windows()
    dropped = probe.shape_loss(dense, tokens, probe.Shape("drop", dropped=(1, 2)), "oracle", 2, 0)
    assert math.isclose(dropped["loss"], model_loss(build_tiny("layerdrop", dropped_layers=[1, 2]), tokens),
                        rel_tol=1e-5)
    half = {kv: probe.shape_loss(dense, tokens, probe.Shape("half", routed=(1, 2), capacity=[0.5, 0.5],
                                                              skipped_tokens_write_kv=kv), "oracle", 2, 0)
            for kv in (True, False)}
    # the first token is one of the ⌊γT⌋ executed, not an extra one
    assert half[True]["executed_share_of_routed_and_dropped"] == 0.5
    # without the skipped tokens' keys/values the executed ones see less context: a different model
    assert abs(half[True]["loss"] - half[False]["loss"]) > 1e-4
    assert abs(half[True]["loss"] - model_loss(dense, tokens)) > 1e-4


def test_oracle_runs_the_first_token_and_the_largest_updates_and_random_choice_is_seeded():
    probe = load_probe()
    update = torch.tensor([[0.1, 5.0, 0.2, 4.0, 0.3, 3.0, 0.0, 2.0]])
    assert probe.executed_positions(update, 0.5, "oracle", None).tolist() == [[0, 1, 3, 5]]
    picks = [probe.executed_positions(torch.zeros(2, 8), 0.5, "random", torch.Generator().manual_seed(s))
             for s in (3, 3, 4)]
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])
    assert all((p[:, 0] == 0).all() and p.shape == (2, 4) for p in picks)


def test_without_skipped_tokens_kv_the_executed_tokens_attend_to_each_other_at_their_own_positions():
    """Reference: the full layer under a mask that hides the skipped tokens' keys (RoPE at the true positions)."""
    probe, dense, tokens = load_probe(), build_tiny("dense"), windows()
    routed_layer, seq_len = 2, tokens.size(1)
    with torch.no_grad():
        h = dense.tok_embeddings(tokens)
        for i, layer in enumerate(dense.layers):
            full = layer(h)
            if i == routed_layer:
                positions = probe.executed_positions((full - h).norm(dim=-1), 0.5, "oracle", None)
                executed = torch.zeros(tokens.shape, dtype=torch.bool).scatter(1, positions, True)
                causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
                masked = layer(h, mask=causal & executed[:, None, :])
                full = torch.where(executed[..., None], masked, h)
            h = full
        logits = dense.output(dense.norm(h)).float()
    reference = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item()
    shape = probe.Shape("one", routed=(routed_layer,), capacity=[0.5], skipped_tokens_write_kv=False)
    got = probe.shape_loss(dense, tokens, shape, "oracle", batch_size=3, seed=0)["loss"]
    assert math.isclose(got, reference, rel_tol=1e-5)


def test_untrained_stt_teacher_in_a_shape_is_the_dense_model_where_it_runs_every_token(workdir):  # noqa: F811
    """The STT rows build the study's STT model in the shape: every token run → dense; a dropped layer → gone."""
    probe = load_probe()
    stt = load_config("stt_train", **{"model.gate": "straight_through", "model.always_run_first_token": True})
    dense = load_trained(load_config("dense_train"), "tiny_qwen2_5_hf")
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(3))
    everything = probe.Shape("all", routed=(0, 1, 2, 3), capacity=[1.0] * 4)
    assert math.isclose(probe.stt_teacher_at_init(stt, everything, tokens, 2)["loss"], model_loss(dense, tokens),
                        rel_tol=1e-5)
    one_dropped = probe.Shape("drop", dropped=(1,), routed=(0, 2, 3), capacity=[1.0] * 3)
    layer_dropping = probe.shape_loss(dense, tokens, probe.Shape("d", dropped=(1,)), "oracle", 2, 0)["loss"]
    assert math.isclose(probe.stt_teacher_at_init(stt, one_dropped, tokens, 2)["loss"], layer_dropping, rel_tol=1e-5)
    # capacity and K/V reach the STT model: at γ 0.5 it is no longer dense, and keeping the skipped tokens' K/V
    # changes what the executed ones see
    half = {kv: probe.stt_teacher_at_init(stt, probe.Shape("half", routed=(1, 2), capacity=[0.5, 0.5],
                                                           skipped_tokens_write_kv=kv), tokens, 2)["loss"]
            for kv in (True, False)}
    assert abs(half[True] - model_loss(dense, tokens)) > 1e-4 and abs(half[True] - half[False]) > 1e-4


def test_a_constant_skip_update_is_the_models_skip_bias_and_the_mean_is_of_skipped_tokens_only():
    probe, dense, tokens = load_probe(), build_tiny("dense"), windows()
    dim = dense.tok_embeddings.embedding_dim
    vectors = {1: torch.linspace(-1, 1, dim), 2: torch.linspace(0.5, -0.5, dim)}
    # dropped layers: the probe's constant update is layer dropping with skip_update: bias at those values
    model = build_tiny("layerdrop", dropped_layers=[1, 2], skip_update="bias")
    model.load_state_dict(dense.state_dict(), strict=False)
    with torch.no_grad():
        for i, vector in vectors.items():
            model.layers[i].skip_bias.update.copy_(vector)
    got = probe.shape_loss(dense, tokens, probe.Shape("drop", dropped=(1, 2)), "oracle", 2, 0, skip_updates=vectors)
    assert math.isclose(got["loss"], model_loss(model, tokens), rel_tol=1e-5)

    # the mean skipped update of a dropped layer: every token but the first, on that layer's true input
    sums = probe.SkippedUpdateSums()
    probe.shape_loss(dense, tokens, probe.Shape("drop", dropped=(1,)), "oracle", 2, 0, skipped_sums=sums)
    with torch.no_grad():
        h = dense.layers[0](dense.tok_embeddings(tokens))
        expected = (dense.layers[1](h) - h)[:, 1:].mean((0, 1))
    torch.testing.assert_close(sums.means()[1], expected, rtol=1e-5, atol=1e-6)

    # a routed layer: only the tokens it skips count, and only they receive the constant
    shape = probe.Shape("half", routed=(1,), capacity=[0.5])
    sums = probe.SkippedUpdateSums()
    plain = probe.shape_loss(dense, tokens, shape, "oracle", 3, 0, skipped_sums=sums)
    assert sums.counts[1] == tokens.numel() - 3 * math.floor(0.5 * tokens.shape[1])
    with torch.no_grad():
        full = dense.layers[1](h)
        norms = (full - h).norm(dim=-1)
        positions = probe.executed_positions(norms, 0.5, "oracle", None)
        skipped = torch.ones_like(norms, dtype=torch.bool).scatter(1, positions, False)
        torch.testing.assert_close(sums.means()[1], (full - h)[skipped].mean(0), rtol=1e-5, atol=1e-6)
    biased = probe.shape_loss(dense, tokens, shape, "oracle", 3, 0, skip_updates={1: sums.means()[1]})
    assert abs(biased["loss"] - plain["loss"]) > 1e-5


def test_only_merges_remeasured_shapes_into_the_probe_in_shape_order_and_refuses_other_settings():
    probe = load_probe()
    names = [shape.name for shape in probe.SHAPES]
    settings = {"config": "c.yaml", "stt_config": "s.yaml", "text": "h.jsonl", "windows": 16, "seq_len": 256, "seed": 0}

    def row(name, selection, loss):
        return {"shape": {"name": name}, "selection": selection, "loss": loss}

    earlier = {**settings, "rows": [row(names[0], "all", 1.0), row(names[2], "oracle", 2.0),
                                    row(names[2], "random", 3.0)]}
    new = {**settings, "rows": [row(names[2], "oracle", 4.0), row(names[2], "random", 5.0),
                                row(names[1], "all", 6.0)]}
    got = probe.merged(earlier, new)
    assert [(r["shape"]["name"], r["selection"], r["loss"]) for r in got["rows"]] == [
        (names[0], "all", 1.0), (names[1], "all", 6.0), (names[2], "oracle", 4.0), (names[2], "random", 5.0)]
    with pytest.raises(ValueError, match="windows"):
        probe.merged(earlier, {**new, "windows": 8})


def test_the_shapes_are_the_studys_and_those_the_committed_probe_measured():
    """No layer list is written in the probe: its shapes are resolved from study.yaml and its parts (the planner on
    block_influence.json), every study run a shape names is in it, and they are the shapes oracle_probe.json holds."""
    probe = load_probe()
    source = PROBE_PY.read_text()
    assert not re.search(r"(dropped|routed)=[(\[]\s*\d", source) and "BY_INFLUENCE" not in source
    measured = {}
    for row in json.loads((PROBE_PY.parent / "oracle_probe.json").read_text())["rows"]:
        measured.setdefault(row["shape"]["name"], row["shape"])
    assert [json.loads(json.dumps(asdict(shape))) for shape in probe.SHAPES] == list(measured.values())
    # a shape is its run's model section: the study's graded recipe keeps each layer's γ in its routed_layers order
    graded = next(shape for shape in probe.SHAPES if shape.name == "stt_bi8_graded")
    assert graded.capacity_of() == dict(zip(graded.routed, [0.25] * 4 + [0.75] * 4))
    # a placement name is the layers it resolves to (the tiny model's 4 layers: every other is 1 and 3)
    tiny = OmegaConf.to_container(load_config("stt_train").model, resolve=True)
    assert tiny["routed_layers"] == "every_other"
    every_other = probe.shape_of_model("x", tiny)
    assert (every_other.routed, every_other.capacity, every_other.dropped) == ((1, 3), [0.5, 0.5], ())
    assert every_other.skipped_tokens_write_kv is False


def test_a_skipped_update_computed_from_the_layer_input_is_applied_where_the_layer_does_not_run():
    """A dropped layer given its own block's update back is the dense model; the fitted affine map recovers an
    update that is exactly affine in the normalised input, and beats the mean on the layer it was fitted to."""
    probe, dense, tokens = load_probe(), build_tiny("dense"), windows()
    with torch.no_grad():
        block_update = {i: (lambda h, layer=dense.layers[i]: layer(h) - h) for i in (1, 2)}
        restored = probe.shape_loss(dense, tokens, probe.Shape("drop", dropped=(1, 2)), "oracle", 2, 0,
                                    skip_updates=block_update)
        assert math.isclose(restored["loss"], model_loss(dense, tokens), rel_tol=1e-5)

        generator = torch.Generator().manual_seed(0)
        inputs = torch.randn(500, 8, generator=generator) * 3
        weight, bias = torch.randn(8, 8, generator=generator), torch.randn(8, generator=generator)
        sums = probe.SkippedUpdateSums()
        sums.add(4, probe.rms_normalised(inputs) @ weight.T + bias, inputs)
        fitted = sums.linear_maps(ridge=1e-6)[4]
        probe_inputs = torch.randn(2, 5, 8, generator=generator)
        expected = probe.rms_normalised(probe_inputs) @ weight.T + bias
        torch.testing.assert_close(fitted(probe_inputs), expected, atol=1e-3, rtol=1e-3)
        assert torch.allclose(sums.means()[4], (probe.rms_normalised(inputs) @ weight.T + bias).mean(0), atol=1e-5)

        shape = probe.Shape("drop", dropped=(2,))
        fit = probe.SkippedUpdateSums()
        probe.shape_loss(dense, tokens, shape, "oracle", 2, 0, skipped_sums=fit)
        losses = {name: probe.shape_loss(dense, tokens, shape, "oracle", 2, 0, skip_updates=updates)["loss"]
                  for name, updates in (("none", None), ("mean", fit.means()), ("linear", fit.linear_maps(1e-2)))}
    assert losses["linear"] < losses["mean"] < losses["none"], losses
