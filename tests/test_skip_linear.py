"""``skip_update: linear``: a token that skips a routed layer, or passes a dropped one, receives ``W·rms(x) + b`` of its
own input (:class:`~torchtune_dtf.modules.SkipLinear`), started at the ridge regression of the block's true update
fitted layer by layer in depth order (``skip_bias_init``). Checked against the blocks and least-squares solves done
by hand on the same hidden states, in the cached decode, the closed form, the recipe's checks and its optimizer."""

import pytest
import torch
from omegaconf import OmegaConf
from torchtune.modules import TransformerSelfAttentionLayer

from tests.conftest import VOCAB, build_tiny, tiny_architecture
from tests.test_recipe import load_config, train_assets, workdir  # noqa: F401  (fixtures)
from torchtune_dtf import closed_form
from torchtune_dtf.modules import DroppedLayer, RoutedSelfAttentionLayer, RoutingContext, routing_group_of
from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.training.recipe_checks import validate_recipe_config
from torchtune_dtf.training.skip_bias_init import fit_skip_linear_maps

ROUTED, DROPPED = 1, (2, 3)  # two adjacent dropped layers: the second's fit depends on the first's map
HYBRID = dict(routed_layers=[ROUTED], dropped_layers=list(DROPPED), skipped_tokens_write_kv=True,
              always_run_first_token=True)


def _teacher():
    return RoutingContext(mode="teacher", beta_ce=torch.tensor(100.0), beta_cu=torch.tensor(100.0))


def _batches(count, seed, rows=4, length=32):
    gen = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, VOCAB, (rows, length), generator=gen)} for _ in range(count)]


def _randomise_maps(model, scale=0.3, seed=3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.layers:
            if getattr(layer, "skip_linear", None) is not None:
                for param in layer.skip_linear.parameters():
                    param.copy_(torch.randn(param.shape, generator=gen) * scale / param.shape[-1] ** 0.5)


def _by_hand(layer, x):
    """``W·rms(x) + b`` computed from the layer's parameters, independently of the module."""
    normalised = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.skip_linear.norm_eps)
    return normalised @ layer.skip_linear.proj.weight.T + layer.skip_linear.proj.bias


def _layer_inputs(model, tokens, layers, routing):
    model.output_hidden_states = list(layers)
    with torch.no_grad():
        *hidden, _ = model(tokens, routing=routing)
    model.output_hidden_states = []
    return dict(zip(layers, hidden))


# ---- the module in the forward -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mod", "stt", "random"])
def test_skip_linear_starts_as_no_skip_update_and_maps_only_the_skipped_tokens(variant, tokens):
    plain = build_tiny(variant)
    mapped = build_tiny(variant, skip_update="linear")
    missing, unexpected = mapped.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all(".skip_linear.proj." in key for key in missing)
    torch.manual_seed(0)
    reference = plain(tokens)
    torch.manual_seed(0)  # random routing draws from the global generator
    torch.testing.assert_close(mapped(tokens), reference, rtol=0, atol=0)  # zero at initialisation

    _randomise_maps(mapped)
    index = next(i for i, layer in enumerate(mapped.layers) if isinstance(layer, RoutedSelfAttentionLayer))
    x = _layer_inputs(plain, tokens, [index], RoutingContext(mode="student"))[index]
    torch.manual_seed(1)
    ctx = RoutingContext(mode="student")
    base = plain.layers[index](x, routing=ctx)
    ran = ctx.layers[index].selected_mask
    assert 0 < ran.sum() < ran.numel()
    torch.manual_seed(1)
    out = mapped.layers[index](x, routing=RoutingContext(mode="student"))
    expected = base + _by_hand(mapped.layers[index], x)
    torch.testing.assert_close(out[~ran], expected[~ran], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[ran], base[ran])
    # The map gives each skipped token its own update, not one vector for all of them.
    updates = (out - base)[~ran]
    assert (updates - updates.mean(0)).norm() > 0.3 * updates.norm()


def test_a_dropped_layer_maps_every_token_and_runs_nothing_else(tokens):
    model = build_tiny("layerdrop", dropped_layers=[2], skip_update="linear")
    layer = model.layers[2]
    assert isinstance(layer, DroppedLayer) and layer.skip_bias is None
    _randomise_maps(model)
    x = torch.randn(2, 7, 64)
    torch.testing.assert_close(layer(x), x + _by_hand(layer, x), rtol=1e-5, atol=1e-5)
    names = sorted(name for name, _ in model.named_parameters() if "skip_linear" in name)
    assert names == ["layers.2.skip_linear.proj.bias", "layers.2.skip_linear.proj.weight"]
    assert all(routing_group_of(name) == "skip_maps" for name in names)


def test_skip_linear_decode_matches_the_full_forward(tokens):
    from tests.test_selective_cache import MAX_LEN, decode_incrementally

    model = build_tiny("stt", skip_update="linear", student_threshold=0.5, routed_layers=[1], dropped_layers=[2],
                       skipped_tokens_write_kv=True)
    _randomise_maps(model, scale=1.0)
    full = model(tokens)
    model.setup_caches(batch_size=tokens.shape[0], dtype=torch.float32, decoder_max_seq_len=MAX_LEN)
    incremental, _ = decode_incrementally(model, tokens, prompt_len=9)
    torch.testing.assert_close(incremental, full, rtol=1e-4, atol=1e-4)


def test_the_map_learns_from_the_lm_loss(tokens):
    model = build_tiny("stt", skip_update="linear", **HYBRID).train()
    _randomise_maps(model)
    model(tokens, routing=_teacher()).float().logsumexp(-1).mean().backward()
    for idx in (ROUTED, *DROPPED):
        assert model.layers[idx].skip_linear.proj.weight.grad.abs().sum() > 0


# ---- the least-squares start ---------------------------------------------------------------------------


def _ridge(inputs, updates, ridge):
    """Reference solve: ``[Wᵀ; b]`` of ``min ‖Δ − [rms(x), 1]·S‖² + ridge·‖W‖²`` by lstsq on an augmented system."""
    z = torch.cat([inputs, torch.ones(len(inputs), 1, dtype=inputs.dtype)], 1).double()
    d = inputs.shape[1]
    penalty = torch.cat([torch.eye(d, dtype=torch.float64) * ridge ** 0.5, torch.zeros(d, 1, dtype=torch.float64)], 1)
    lhs = torch.cat([z, penalty], 0)
    rhs = torch.cat([updates.double(), torch.zeros(d, updates.shape[1], dtype=torch.float64)], 0)
    return torch.linalg.lstsq(lhs, rhs).solution


def test_each_map_is_the_ridge_regression_on_its_own_inputs_in_depth_order():
    model = build_tiny("stt", skip_update="linear", **HYBRID)
    batches = _batches(3, seed=5)  # 384 tokens per layer for 65 coefficients per output
    ridge = 0.05
    report = fit_skip_linear_maps(model, batches, _teacher, ridge)
    assert sorted(report) == [ROUTED, *DROPPED]

    # Reference: the fitted model's own trajectory (the second dropped layer's input carries the first one's map).
    inputs, updates = {i: [] for i in report}, {i: [] for i in report}
    for batch in batches:
        ctx = _teacher()
        hidden = _layer_inputs(model, batch["tokens"], sorted(report), ctx)
        for idx, x in hidden.items():
            skipped = torch.ones(x.shape[:2], dtype=torch.bool)
            if idx == ROUTED:
                skipped &= ~ctx.layers[ROUTED].selected_mask
            update = _true_update(model, idx, x)
            inputs[idx].append(model.layers[idx].skip_linear.normalise(x[skipped]))
            updates[idx].append(update[skipped])
    for idx in report:
        x, delta = torch.cat(inputs[idx]), torch.cat(updates[idx])
        solution = _ridge(x, delta, ridge).float()
        proj = model.layers[idx].skip_linear.proj
        torch.testing.assert_close(proj.weight.detach(), solution[:-1].T, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(proj.bias.detach(), solution[-1], rtol=1e-3, atol=1e-4)
        predicted = torch.cat([x, torch.ones(len(x), 1)], 1) @ solution
        explained = 1 - (delta - predicted).pow(2).sum() / delta.pow(2).sum()
        assert report[idx]["tokens"] == len(x)
        assert report[idx]["explained"] == pytest.approx(float(explained), abs=1e-4)

    # Depth order is a choice the result carries: fitted on the inputs it gets before the first dropped layer has a
    # map (all maps fitted at once), the second dropped layer's map differs.
    unfitted = build_tiny("stt", skip_update="linear", **HYBRID)
    second = DROPPED[1]
    hidden = [_layer_inputs(unfitted, b["tokens"], [second], _teacher())[second] for b in batches]  # [b, s, d] each
    x = unfitted.layers[second].skip_linear.normalise(torch.cat([h.flatten(0, 1) for h in hidden]))
    delta = torch.cat([_true_update(unfitted, second, h).flatten(0, 1) for h in hidden])
    at_once = _ridge(x, delta, ridge).float()[:-1].T
    fitted = model.layers[second].skip_linear.proj.weight.detach()
    assert (at_once - fitted).norm() > 0.05 * fitted.norm()


def _true_update(model, idx, x):
    with torch.no_grad():
        return TransformerSelfAttentionLayer.forward(model.layers[idx], x) - x


def test_in_bf16_the_fitted_map_predicts_held_out_updates_better_than_the_mean():
    """What the map is for, in the dtype real configs train in: on tokens it was not fitted on, its prediction of
    each dropped layer's update is closer than the mean update's (the skip bias's start), both taken on the fitted
    model's trajectory. (The tiny model's random blocks are far less linear than a pretrained model's: the real
    model's share is in experiments/probes/dropped_layer_replacement.md.)"""
    model = build_tiny("stt", skip_update="linear", **HYBRID).to(torch.bfloat16)
    fitting, held_out = _batches(24, seed=5), _batches(2, seed=9)
    fit_skip_linear_maps(model, fitting, _teacher, 0.05)
    for idx in DROPPED:
        mean = torch.cat([_true_update(model, idx, x).float().flatten(0, 1) for x in
                          (_layer_inputs(model, b["tokens"], [idx], _teacher())[idx] for b in fitting)]).mean(0)
        map_error = mean_error = 0.0
        for batch in held_out:
            x = _layer_inputs(model, batch["tokens"], [idx], _teacher())[idx]
            delta = _true_update(model, idx, x).float()
            with torch.no_grad():
                mapped = model.layers[idx].skip_linear(x).float()
            map_error += float((delta - mapped).pow(2).sum())
            mean_error += float((delta - mean).pow(2).sum())
        assert map_error < 0.92 * mean_error, (idx, map_error, mean_error)


@pytest.mark.parametrize("section, rates, message", [
    ({"batches": 2}, {}, r"skip_bias_init.ridge is missing"),
    ({"batches": 2, "ridge": -1.0}, {}, r"skip_bias_init.ridge must be ≥ 0"),
    ({"batches": 0}, {"skip_maps": None}, r"missing required key\(s\): learning_rates.skip_maps"),
])
def test_bad_linear_map_configs_are_refused_naming_the_key(section, rates, message):
    cfg = load_config("stt_train", **{"model.skip_update": "linear", "learning_rates.skip_maps": 1.0e-4})
    cfg.skip_bias_init = OmegaConf.create(section)
    for group, value in rates.items():
        if value is None:
            del cfg.learning_rates[group]
    with pytest.raises(ValueError, match=message):
        validate_recipe_config(cfg)


def test_configs_without_linear_maps_need_no_skip_maps_rate():
    cfg = load_config("stt_train")
    assert "skip_maps" not in cfg.learning_rates
    validate_recipe_config(cfg)


def test_recipe_fits_the_maps_and_trains_them_in_their_own_group(workdir):  # noqa: F811
    overrides = {"model.routed_layers": [ROUTED], "model.dropped_layers": list(DROPPED), "model.skip_update": "linear",
                 "learning_rates.skip_maps": 3.0e-4, "skip_bias_init": {"batches": 2, "ridge": 0.05}}
    fitted = RoutedFinetuneRecipe(cfg := load_config("stt_train", **overrides))
    fitted.setup(cfg)
    plain_cfg = load_config("stt_train", **{**overrides, "skip_bias_init": {"batches": 0}})
    plain = RoutedFinetuneRecipe(plain_cfg)
    plain.setup(plain_cfg)
    for idx in (ROUTED, *DROPPED):  # off: zero, as before the section
        assert plain._model.layers[idx].skip_linear.proj.weight.abs().max() == 0
    fit_skip_linear_maps(plain._model, plain._first_training_batches(2), lambda: plain._routing_context("teacher"), 0.05)
    for idx in (ROUTED, *DROPPED):
        ours, theirs = fitted._model.layers[idx].skip_linear.proj, plain._model.layers[idx].skip_linear.proj
        assert ours.weight.norm() > 0
        torch.testing.assert_close(ours.weight.detach(), theirs.weight.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours.bias.detach(), theirs.bias.detach(), rtol=1e-4, atol=1e-5)
    groups = {group["name"]: group for group in fitted._optimizer.param_groups}
    assert groups["skip_maps"]["lr"] == 3.0e-4 or groups["skip_maps"]["initial_lr"] == 3.0e-4
    maps = {id(p) for idx in (ROUTED, *DROPPED) for p in fitted._model.layers[idx].skip_linear.parameters()}
    assert {id(p) for p in groups["skip_maps"]["params"]} == maps


# ---- what it costs -----------------------------------------------------------------------------------------


def test_closed_form_counts_the_map_on_the_tokens_it_serves():
    shape = closed_form.model_shape_from_config({"_component_": "torchtune_dtf.models.qwen2_5.routed_qwen2",
                                                 **tiny_architecture()})
    def routing(skip_update):
        return closed_form.RoutingShape(variant="stt", routed_layers=(1,), capacity=(0.5,), router_hidden=8,
                                        predictor_width=4, dropped_layers=DROPPED, skip_update=skip_update)
    seq_len, d = 32, shape.embed_dim
    plain = closed_form.forward_flops(shape, routing("none"), seq_len)
    mapped = closed_form.forward_flops(shape, routing("linear"), seq_len)
    served = (seq_len - closed_form.num_selected(0.5, seq_len)) + len(DROPPED) * seq_len
    assert mapped["routers"] - plain["routers"] == served * 2 * d * d
    assert mapped["total"] - plain["total"] == served * 2 * d * d
    assert routing("linear").skip_update_params(shape) == d * d + d

