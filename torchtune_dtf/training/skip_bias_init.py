"""Start each skip bias at the mean update of the tokens it stands in for (``skip_bias_init``).

A token that skips a routed layer, and every token at a dropped layer, receives the layer's skip bias ``b``
(``skip_update: bias``, :class:`~torchtune_dtf.modules.predictors.SkipBias`) instead of the block's update
``block(x_t) − x_t``. The constant that loses least, before any training, is the mean of the updates it replaces:
no later layer can add a constant back (Qwen's MLP and output projections have no bias), and
``experiments/frontier/skip_bias_probe.md`` measured that mean worth 0.05–0.18 nats of held-out loss in the
study's ≈ 0.90–0.72 shapes before training (2.2 nats where skipped tokens keep their K/V at γ 0.5 everywhere).
Learned from zero, the bias moves by at most about the router learning rate per step (Adam), far less than the
mean's norm (8–60 on SmolLM2-135M); started at the mean, the fine-tune begins where the probe ended. Measured on the
quickstart's ≈ 0.81 recipe the backbone makes up most of the difference within a few steps anyway
(``docs/routing.md``), so no shipped config turns it on.

The mean is taken over the *real* tokens a layer skips on the first training batches, with the model as loaded:
a routed layer's teacher selection at step 0 (what training will skip), a dropped layer's every token but the
first of each row (the attention-sink token's update is outsized, and one sink per row would pull the mean).
Each layer's update is measured on its own input in that forward (earlier skip biases still at their loaded
values), by running its stock block once more beside the routed forward.

Works on a plain or FSDP2-sharded model: the extra block call runs in a forward pre-hook registered after FSDP's
own (so the parameters are unsharded), and the sums are all-reduced over the ranks.
"""

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchtune_dtf.modules.layers import RoutedSelfAttentionLayer, _dense_forward
from torchtune_dtf.modules.routing_context import RoutingContext
from torchtune_dtf.training.calibration import CalibrationBatch, _forward, _valid


def skip_bias_layers(model: nn.Module) -> Dict[int, nn.Module]:
    """``{layer index: layer}`` of the layers with a skip bias (dropped or routed, ``skip_update: bias``)."""
    return {idx: layer for idx, layer in enumerate(model.layers) if getattr(layer, "skip_bias", None) is not None}


class _SkippedUpdates:
    """Per layer, the sum ``[d]`` (float64) and count of the true updates of the tokens it skips, gathered by
    forward hooks while the model runs a batch."""

    def __init__(self, model: nn.Module, valid: Callable[[], torch.Tensor]):
        self.layers = skip_bias_layers(model)
        self.sums: Dict[int, torch.Tensor] = {}
        self.counts: Dict[int, torch.Tensor] = {}
        self._valid = valid  # the real tokens [b, s] of the batch being run
        self._pending: Dict[int, torch.Tensor] = {}
        self._handles: List = []
        for idx, layer in self.layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(idx), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post_hook(idx), with_kwargs=True))

    def _pre_hook(self, idx: int):
        def hook(layer, args, kwargs):
            x = args[0] if args else kwargs["x"]
            self._pending[idx] = _dense_forward(layer, x, kwargs.get("mask"), kwargs.get("input_pos")) - x
        return hook

    def _post_hook(self, idx: int):
        def hook(layer, args, kwargs, output):
            update = self._pending.pop(idx)  # [b, s, d]
            skipped = self._valid().clone()  # [b, s]
            if isinstance(layer, RoutedSelfAttentionLayer):  # the decoder hands it its routing view
                skipped &= ~kwargs["routing"].record_of(idx).selected_mask
            else:
                skipped[:, 0] = False  # each row's first token: the attention sink
            self.add(idx, update[skipped])
        return hook

    def add(self, idx: int, updates: torch.Tensor) -> None:
        """``updates [n, d]``: the true updates of n skipped tokens of layer ``idx``."""
        total = updates.double().sum(0)
        count = torch.tensor(float(updates.shape[0]), dtype=torch.float64, device=updates.device)
        self.sums[idx] = self.sums[idx] + total if idx in self.sums else total
        self.counts[idx] = self.counts[idx] + count if idx in self.counts else count

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def mean_skipped_updates(
    model: nn.Module,
    batches: Sequence[CalibrationBatch],
    routing: Callable[[], RoutingContext],
    all_reduce: bool = False,
) -> Dict[int, torch.Tensor]:
    """The mean true update ``[d]`` of the real tokens each skip-bias layer skips on ``batches``.

    Args:
        model: a routed decoder (plain or FSDP2-sharded) whose layers are called with keyword ``mask``,
            ``input_pos`` and ``routing``, as torchtune's decoder calls them.
        batches: the text (:data:`~torchtune_dtf.training.calibration.CalibrationBatch`); padding is in no sum.
        routing: makes each batch's fresh :class:`RoutingContext`; its mode decides what a routed layer skips
            (``"teacher"``: the teacher's selection, as training skips).
        all_reduce (bool): sum over the ranks of the default process group (each rank passing its own batches).

    Returns:
        Dict[int, torch.Tensor]: ``{layer index: mean update [d]}`` in float32, for every layer with a skip bias.
        A layer that skipped no real token on ``batches`` has no entry.
    """
    current: Dict[str, Optional[CalibrationBatch]] = {"batch": None}
    gathered = _SkippedUpdates(model, valid=lambda: _valid(current["batch"], current["batch"]["tokens"]))
    try:
        for batch in batches:
            current["batch"] = batch
            _forward(model, batch, routing())
    finally:
        gathered.remove()
    means = {}
    for idx in sorted(gathered.sums):
        total, count = gathered.sums[idx], gathered.counts[idx]
        if all_reduce:
            dist.all_reduce(total)
            dist.all_reduce(count)
        if count.item() > 0:
            means[idx] = (total / count).float()
    return means


@torch.no_grad()
def init_skip_biases(
    model: nn.Module,
    batches: Sequence[CalibrationBatch],
    routing: Callable[[], RoutingContext],
    all_reduce: bool = False,
) -> Dict[int, float]:
    """Set every skip bias to :func:`mean_skipped_updates` on ``batches``. Returns ``{layer: ‖b‖₂}`` of the
    biases set (a report for the log). Raises when the model has no skip bias to set."""
    layers = skip_bias_layers(model)
    if not layers:
        raise ValueError("skip_bias_init: the model has no skip bias to initialise (it needs model.skip_update: bias)")
    means = mean_skipped_updates(model, batches, routing, all_reduce=all_reduce)
    norms = {}
    for idx, mean in means.items():
        param = layers[idx].skip_bias.update
        local = param.to_local() if hasattr(param, "to_local") else None
        if local is not None:  # an FSDP2 shard: this rank's slice of the full vector
            from torch.distributed.tensor import distribute_tensor

            param.copy_(distribute_tensor(mean.to(local.dtype), param.device_mesh, param.placements))
        else:
            param.copy_(mean.to(param.dtype))
        norms[idx] = float(mean.norm())
    return norms
