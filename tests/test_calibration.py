"""torchtune_dtf.training.calibration: a threshold student calibrated after training executes its budget, keeps its own
ranking, and the recipe applies it before the final checkpoint."""

import pytest
import torch

from tests.conftest import VOCAB, build_tiny, routing_kwargs, tiny_architecture
from tests.test_recipe import load_config, read_log, run_recipe, workdir, train_assets  # noqa: F401
from torchtune_dtf.models import qwen2_5
from torchtune_dtf.modules import RoutingContext
from torchtune_dtf.training.recipe_checks import validate_recipe_config
from torchtune_dtf.training.calibration import (
    calibratable_layers,
    calibrate_student_routers,
    calibrate_to_teacher,
    student_fractions,
)

BETAS = dict(beta_ce=100.0, beta_cu=100.0)  # what the shipped schedules reach


def text(seed, batch=4, seq_len=64):
    return [{"tokens": torch.randint(0, VOCAB, (batch, seq_len), generator=torch.Generator().manual_seed(seed))}]


def push_routers(model, shift):
    """A student that has drifted: every router logit moved by ``shift`` (e.g. 'select everything')."""
    with torch.no_grad():
        for layer in calibratable_layers(model):
            layer.causal_router.out.bias.add_(shift)


@pytest.mark.parametrize("variant", ["mod", "sdt", "stt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calibration_brings_a_drifted_student_to_its_target(variant, dtype):
    model = build_tiny(variant, always_run_first_token=False).to(dtype)
    push_routers(model, 8.0)
    batches = text(0)
    assert all(f > 0.95 for f in student_fractions(model, batches).values())  # drifted: runs (almost) everything
    targets = {layer.layer_idx: 0.5 for layer in calibratable_layers(model)}
    after = calibrate_student_routers(model, batches, targets, rounds=3)
    # 256 tokens: fp32 lands on the quantile; a bf16 bias has 8 mantissa bits, so its logit grid is coarser.
    tolerance = 1 / 256 + 1e-6 if dtype == torch.float32 else 0.05
    assert all(abs(f - 0.5) <= tolerance for f in after.values()), after
    # Unseen text of the same kind: the budget generalises (it is a threshold, not a per-batch top-k).
    unseen = student_fractions(model, text(1, batch=8))
    assert all(abs(f - 0.5) < 0.12 for f in unseen.values()), unseen


def chained_routing(variant, num_layers=8):
    """A tiny model whose routed layers are coupled the way trained ones are, only more so: each routed block
    writes its update along one direction u (a rank-1 MLP output, large), and each causal router's logit is
    |u · RMSNorm(x)| (two hidden units ±u, SiLU(c) + SiLU(−c) ≈ |c|). A token's logit at a routed layer is thus
    high iff an earlier routed layer ran it, so a layer's fraction above a fixed threshold depends on how many
    tokens every earlier routed layer runs. Router biases start at +8: every token runs (a student left by a
    capacity curriculum)."""
    torch.manual_seed(0)
    model = qwen2_5.routed_qwen2(variant, **{**tiny_architecture(), "num_layers": num_layers},
                                 **routing_kwargs(variant, always_run_first_token=False)).eval()
    dim = tiny_architecture()["embed_dim"]
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(dim, generator=gen)
    u /= u.norm()
    with torch.no_grad():
        for layer in calibratable_layers(model):
            layer.mlp.w2.weight.copy_(20.0 * torch.outer(u, torch.randn(layer.mlp.w2.weight.shape[1], generator=gen)))
            router = layer.causal_router
            router.hidden.weight.zero_()
            router.hidden.weight[0, :dim], router.hidden.weight[1, :dim] = 10.0 * u, -10.0 * u
            router.hidden.bias.zero_()
            router.out.weight.zero_()
            router.out.weight[0, :2] = 1.0
            router.out.bias.fill_(8.0)
    return model


@pytest.mark.parametrize("variant", ["mod", "sdt", "stt"])
def test_one_round_calibrates_every_layer_of_a_coupled_stack(variant):
    # Shifting every layer from one forward fixes one layer per round: a round measured while the first routed
    # layer ran every token puts the second one's threshold inside the "ran before" mode, and it then runs ~1/4
    # (with 3 rounds and 14 coupled layers SmolLM2-135M's 4th–14th routed layers ended at 0.48 down to 0.13).
    # Calibration goes in depth order, so one round already brings all four layers to their target.
    model = chained_routing(variant)
    batches = [{"tokens": torch.randint(0, VOCAB, (4, 64), generator=torch.Generator().manual_seed(seed))} for seed in (0, 1)]
    before = student_fractions(model, batches)
    assert len(before) == 4 and all(f == 1.0 for f in before.values()), before
    after = calibrate_student_routers(model, batches, {idx: 0.5 for idx in before}, rounds=1)
    assert all(abs(f - 0.5) <= 0.03 for f in after.values()), after
    # The coupling is real: the same thresholds with the first routed layer running every token again would
    # pass far more than half at the later layers.
    first = calibratable_layers(model)[0]
    with torch.no_grad():
        first.causal_router.out.bias.add_(100.0)
    rerun = student_fractions(model, batches)
    assert all(rerun[layer.layer_idx] > 0.6 for layer in calibratable_layers(model)[1:]), rerun


def test_calibration_keeps_the_routers_ranking_and_it_is_not_position_order(tokens):
    model = build_tiny("stt", always_run_first_token=False).to(torch.bfloat16)
    batches = text(0, batch=4, seq_len=64)
    ctx = RoutingContext(mode="student")
    model(batches[0]["tokens"], routing=ctx)
    logits_before = ctx.layers[1].student_logits  # layer 1 is the first routed layer; its input is unchanged
    calibrate_student_routers(model, batches, {i: 0.25 for i in ctx.layers}, rounds=2)
    ctx = RoutingContext(mode="student")
    model(batches[0]["tokens"], routing=ctx)
    selected = ctx.layers[1].selected_mask
    # A bias shift moves every logit alike: the selected tokens are the top of the *old* logits.
    cutoff = logits_before[~selected].max()
    assert bool((logits_before[selected] >= cutoff).all())
    # ... and that ranking carries a signal: the chosen tokens are not the first (or last) quarter of the window.
    positions = torch.arange(64).expand(4, -1)
    mean_position = positions[selected].float().mean().item()
    assert 16 < mean_position < 48, mean_position
    assert 0.2 < selected.float().mean().item() < 0.3


def test_calibrate_to_teacher_targets_what_the_dynamic_teacher_runs():
    # At β = 100 this model's gates lie in about [0.92, 0.98]: a threshold inside gives a non-trivial teacher.
    model = build_tiny("stt", teacher_selection="threshold", gate_threshold=0.965, always_run_first_token=False)
    push_routers(model, 8.0)
    batches = text(3)
    teacher = RoutingContext(mode="teacher", **BETAS)
    report = calibrate_to_teacher(model, batches, teacher, rounds=3)
    ctx = RoutingContext(mode="teacher", **BETAS)
    model(batches[0]["tokens"], routing=ctx)
    for idx, row in report.items():
        assert row["target"] == pytest.approx(ctx.layers[idx].teacher_mask.float().mean().item())
        assert abs(row["after"] - row["target"]) <= 1 / 256 + 1e-6
    assert all(0.1 < r["target"] < 0.5 and r["before"] > 0.95 for r in report.values()), report
    assert model.training is False  # left as it was


def test_calibration_refuses_targets_for_other_layers():
    model = build_tiny("mod")
    with pytest.raises(ValueError, match="targets name layers"):
        calibrate_student_routers(model, text(0), {7: 0.5}, rounds=1)
    with pytest.raises(ValueError, match="at least one round"):
        calibrate_student_routers(model, text(0), {1: 0.5, 3: 0.5}, rounds=0)


def test_recipe_calibrates_the_final_student_before_saving(workdir):  # noqa: F811
    from torchtune_dtf.training.calibration import batch_for_calibration, teacher_fractions

    cfg = load_config("stt_train", **{"student_calibration.batches": 2, "student_calibration.rounds": 3})
    recipe = run_recipe(cfg)
    log = read_log(workdir)
    final = log[max(log)]
    layers = [i for i in (1, 3)]
    for i in layers:
        assert abs(final[f"calibration/after_layer_{i}"] - final[f"calibration/target_layer_{i}"]) < 0.02
        # γ = 0.5 of each padded row; measured on real tokens (padding excluded) the teacher runs a bit less.
        assert 0.35 < final[f"calibration/target_layer_{i}"] <= 0.5
    # The saved model is the calibrated one: the router biases in the final checkpoint are the calibrated
    # model's, and that model's student runs the target on the calibration batches.
    from safetensors.torch import load_file

    saved = load_file(str(workdir / "outputs" / "epoch_0" / "routing.safetensors"))
    state = recipe._model.state_dict()
    for i in layers:
        key = next(k for k in saved if k.endswith(f"layers.{i}.causal_router.out.bias"))
        torch.testing.assert_close(saved[key], state[key.removeprefix("model.")] if key not in state else state[key])
    dataset, collate = recipe._dataloader.dataset, recipe._dataloader.collate_fn
    batches = [batch_for_calibration(collate([dataset[i] for i in range(n * 2, n * 2 + 2)]), -100) for n in range(2)]
    fractions = student_fractions(recipe._model, batches)
    targets = teacher_fractions(recipe._model, batches, RoutingContext(mode="teacher", beta_ce=100.0, beta_cu=100.0))
    for i in layers:
        assert fractions[i] == pytest.approx(final[f"calibration/after_layer_{i}"])
        assert targets[i] == pytest.approx(final[f"calibration/target_layer_{i}"])


@pytest.mark.parametrize("overrides, message", [
    ({"student_calibration.batches": -1}, "student_calibration.batches must be an integer"),
    ({"student_calibration.rounds": 0}, "student_calibration.rounds must be a positive integer"),
    ({"model.student_routing_mode": "topk"}, "'topk' already runs γ by rank"),
    ({"model.student_routing_mode": "window_topk", "model.student_threshold": None, "model.student_window": 16},
     "'window_topk' already runs γ by rank"),
])
def test_invalid_student_calibration_settings_are_rejected(overrides, message):
    cfg = load_config("stt_train", **overrides)
    with pytest.raises(ValueError, match=message):
        validate_recipe_config(cfg)


def test_calibration_key_is_required():
    cfg = load_config("mod_train")
    del cfg["student_calibration"]
    with pytest.raises(ValueError, match="student_calibration"):
        validate_recipe_config(cfg)
