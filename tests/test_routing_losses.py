"""torchtune_dtf.training.routing_losses (and the parameter groups of torchtune_dtf.recipes.routed_finetune):
training_loss, the one assembly of the routed objective (recipe and benchmarks)."""

import pytest
import torch

from tests.conftest import build_tiny
from torchtune_dtf.modules import ROUTING_MODULE_GROUPS, RoutingContext
from torchtune_dtf.recipes.routed_finetune import param_group_of
from torchtune_dtf.training.recipe_checks import PARAM_GROUPS
from torchtune_dtf.training.routing_losses import auxiliary_losses, training_loss


def test_training_loss_is_lm_plus_weighted_auxiliaries_plus_distillation(tokens):
    model = build_tiny("stt")
    routing = RoutingContext(mode="teacher", beta_ce=100.0, beta_cu=100.0)
    lm = model(tokens, routing=routing).float().logsumexp(-1).mean()  # any scalar of the forward
    aux = auxiliary_losses(routing)
    distill = torch.tensor(0.7)
    loss, parts = training_loss(lm, routing, (0.5, 2.0, 3.0), distill, 0.25)
    expected = lm + 0.5 * aux["pred"] + 2.0 * aux["causal"] + 3.0 * aux["g_reg"] + 0.25 * distill
    torch.testing.assert_close(loss, expected)
    assert set(parts) == {"lm", "pred", "causal", "g_reg", "distill"}
    assert aux["pred"] > 0 and aux["causal"] > 0  # the weights multiply something
    assert all(not p.requires_grad for p in parts.values())


def test_training_loss_of_a_model_without_routing_is_the_lm_loss(tokens):
    lm = torch.tensor(3.0, requires_grad=True)
    loss, parts = training_loss(lm, None, None)
    assert loss is lm and set(parts) == {"lm"}
    with pytest.raises(ValueError, match="auxiliary loss weights"):
        training_loss(lm, RoutingContext(mode="teacher"), None)


@pytest.mark.parametrize("variant", ["mod", "sdt", "stt"])
def test_every_routing_parameter_has_its_modules_group(variant):
    model = build_tiny(variant)
    for name, _ in model.named_parameters():
        module = next((part for part in name.split(".") if part in ROUTING_MODULE_GROUPS), None)
        assert param_group_of(name) == (ROUTING_MODULE_GROUPS[module] if module else "backbone"), name
    groups = {param_group_of(name) for name, _ in model.named_parameters()}
    assert groups <= {"backbone", *PARAM_GROUPS} and "routers" in groups
