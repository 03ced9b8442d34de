"""Start each skip bias at the mean update of the tokens it stands in for, and each skip linear map at the
least-squares map of their inputs to it (``skip_bias_init``).

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

A skip linear map (``skip_update: linear``, :class:`~torchtune_dtf.modules.predictors.SkipLinear`) gives each token
``W·rms(x_t) + b`` instead. It starts at the ridge regression of the block's true updates on the normalised inputs of
the tokens it stands in for (every real token of a dropped layer, the sink included: the map sees the sink's
distinctive input, so its outsized update is fitted rather than averaged in), ``argmin Σ‖Δ_t − W·rms(x_t) − b‖² +
ridge·‖W‖²`` (``skip_bias_init.ridge``; b is not shrunk). The maps are fitted one layer at a time in depth order, each
on the inputs the layers before it, with their maps already set, hand it: fitted together on the inputs of a model
without maps, many adjacent maps compound (``experiments/frontier/skip_bias_probe.md``, ten dropped layers: worse
than no map), while in depth order each map corrects what the earlier ones left. The batches run through the model
together, layer by layer, so that costs one forward per batch. ``experiments/probes/dropped_layer_replacement.md``
measured what the map keeps after 20 distilled steps of layer dropping (0.09 nats more than plain dropping, where the
mean update keeps 0.02). The fit runs on one device (the recipe refuses it under torchrun).

The mean works on a plain or FSDP2-sharded model: the extra block call runs in a forward pre-hook registered after FSDP's
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


def skip_linear_layers(model: nn.Module) -> Dict[int, nn.Module]:
    """``{layer index: layer}`` of the layers with a skip linear map (dropped or routed, ``skip_update: linear``)."""
    return {idx: layer for idx, layer in enumerate(model.layers) if getattr(layer, "skip_linear", None) is not None}


class SkippedUpdateStats:
    """Per layer, statistics of the true updates ``Δ [n, d]`` of the tokens it skips (float64): their sum ``[d]`` and
    count, and, where the tokens' normalised inputs are given (a skip linear map's fit), the normal equations
    ``Σ z zᵀ [d+1, d+1]`` and ``Σ z Δᵀ [d+1, d]`` with ``z = (rms(x), 1)``, and ``Σ‖Δ‖²``. The skip-bias and skip-map
    initialisations fill one; so do the frontier probes (``experiments/frontier/oracle_probe.py``)."""

    def __init__(self) -> None:
        self.sums: Dict[int, torch.Tensor] = {}
        self.counts: Dict[int, torch.Tensor] = {}
        self.gram: Dict[int, torch.Tensor] = {}
        self.cross: Dict[int, torch.Tensor] = {}
        self.squares: Dict[int, torch.Tensor] = {}

    def add(self, idx: int, updates: torch.Tensor, normalised_inputs: Optional[torch.Tensor] = None) -> None:
        """``updates [n, d]``: the true updates of n skipped tokens of layer ``idx``; ``normalised_inputs [n, d]``:
        their inputs as the layer's skip linear map reads them."""
        updates = updates.double()
        parts = {"sums": updates.sum(0), "counts": torch.tensor(float(len(updates)), dtype=torch.float64,
                                                                  device=updates.device)}
        if normalised_inputs is not None:
            z = torch.cat([normalised_inputs.double(), updates.new_ones(len(updates), 1)], 1)
            parts.update(gram=z.T @ z, cross=z.T @ updates, squares=updates.pow(2).sum())
        for name, value in parts.items():
            store = getattr(self, name)
            store[idx] = store[idx] + value if idx in store else value

    def mean(self, idx: int) -> torch.Tensor:
        """The mean skipped update ``[d]`` of layer ``idx`` (float32)."""
        return (self.sums[idx] / self.counts[idx]).float()

    def ridge_solution(self, idx: int, ridge: float) -> torch.Tensor:
        """``S [d+1, d]`` (``Wᵀ`` over ``b``) minimising ``Σ‖Δ_t − W·z_t − b‖² + ridge·‖W‖²`` over the tokens added
        with their inputs (float64; the bias is not shrunk)."""
        gram = self.gram[idx]
        penalty = torch.full((len(gram),), float(ridge), dtype=gram.dtype, device=gram.device)
        penalty[-1] = 0.0
        return torch.linalg.solve(gram + torch.diag(penalty), self.cross[idx])

    def explained(self, idx: int, solution: torch.Tensor) -> float:
        """The share of ``Σ‖Δ‖²`` that ``solution [d+1, d]`` predicts: ``1 − Σ‖Δ_t − Sᵀz_t‖² / Σ‖Δ‖²``, from the sums
        alone (``Σ‖Δ − Sᵀz‖² = Σ‖Δ‖² − 2·tr(Sᵀ C) + tr(Sᵀ G S)``, with ``C = Σ z Δᵀ`` and ``G = Σ z zᵀ``)."""
        gram, cross, square = self.gram[idx], self.cross[idx], self.squares[idx]
        residual = square - 2 * (solution * cross).sum() + (solution * (gram @ solution)).sum()
        return float(1 - residual / square)


class _SkippedUpdates:
    """Forward hooks that add, while the model runs a batch, the true update of every token each of ``layers`` skips
    to ``stats`` (:class:`SkippedUpdateStats`): a routed layer's unselected real tokens, a dropped layer's real tokens but
    each row's first (the attention sink's update is outsized, and one sink per row would pull the mean)."""

    def __init__(self, layers: Dict[int, nn.Module], valid: Callable[[], torch.Tensor]):
        self.stats = SkippedUpdateStats()
        self._valid = valid  # the real tokens [b, s] of the batch being run
        self._pending: Dict[int, torch.Tensor] = {}
        self._handles: List = []
        for idx, layer in layers.items():
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
                skipped[:, 0] = False
            self.stats.add(idx, update[skipped])
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """``param.copy_(value)`` for a plain parameter or an FSDP2 shard (``value`` is the full tensor)."""
    if hasattr(param, "to_local"):  # an FSDP2 shard: this rank's slice of the full tensor
        from torch.distributed.tensor import distribute_tensor

        param.copy_(distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements))
    else:
        param.copy_(value.to(param.dtype))


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
    hooks = _SkippedUpdates(skip_bias_layers(model), valid=lambda: _valid(current["batch"], current["batch"]["tokens"]))
    try:
        for batch in batches:
            current["batch"] = batch
            _forward(model, batch, routing())
    finally:
        hooks.remove()
    gathered = hooks.stats
    means = {}
    for idx in sorted(gathered.sums):
        if all_reduce:  # in place: the stats then hold every rank's tokens
            dist.all_reduce(gathered.sums[idx])
            dist.all_reduce(gathered.counts[idx])
        if gathered.counts[idx].item() > 0:
            means[idx] = gathered.mean(idx)
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
        _copy_into(layers[idx].skip_bias.update, mean)
        norms[idx] = float(mean.norm())
    return norms


@torch.no_grad()
def fit_skip_linear_maps(
    model: nn.Module,
    batches: Sequence[CalibrationBatch],
    routing: Callable[[], RoutingContext],
    ridge: float,
) -> Dict[int, Dict[str, float]]:
    """Set every skip linear map to the ridge regression of the true updates of the tokens it stands in for on
    their normalised inputs, one layer at a time in depth order (module docstring).

    The batches go through the model together, layer by layer, as the decoder runs them (each with its own routing
    context): at a layer with a map, each batch's tokens it skips are gathered with its block's true update on their
    input, the map is solved from all of them, and each batch's output then gets the map, so the next layers see
    what the fitted model computes. One forward per batch in all, and the selection of a routed layer is its
    teacher's on the input the fitted layers before it give (the map only changes the tokens it skips).

    Args:
        model: a routed decoder (:class:`~torchtune_dtf.modules.RoutedTransformerDecoder`, on one device).
        batches: the text (:data:`~torchtune_dtf.training.calibration.CalibrationBatch`); padding is in no fit.
        routing: makes each batch's fresh :class:`RoutingContext`; its mode decides what a routed layer skips
            (``"teacher"``: the teacher's selection, as training skips).
        ridge (float): ``λ ≥ 0`` of ``λ‖W‖²`` (not on ``b``); ``0`` solves plain least squares.

    Returns:
        Dict[int, Dict[str, float]]: per layer set, a report for the log: ``tokens`` fitted on and the share of the
        updates' total square the map explains on them (``explained``: 1 − Σ‖Δ − map‖² / Σ‖Δ‖²). A layer that
        skipped no real token is left at zero. Raises when the model has no skip linear map to fit.
    """
    layers = skip_linear_layers(model)
    if not layers:
        raise ValueError("skip_bias_init: the model has no skip linear map to fit (it needs model.skip_update: linear)")
    runs = []  # per batch: its hidden state before the next layer, routing context, token layout and real tokens
    for batch in batches:
        tokens, mask, input_pos = batch["tokens"], batch.get("mask"), batch.get("input_pos")
        runs.append({"h": model.tok_embeddings(tokens), "ctx": routing(), "mask": mask, "input_pos": input_pos,
                     "layout": model._token_layout(*tokens.shape, mask, input_pos, tokens.device),
                     "valid": _valid(batch, tokens)})
    report = {}
    routing_layers = set(model.routing_layer_indices)
    for idx, layer in enumerate(model.layers[: max(layers) + 1]):  # no later layer changes a fit
        if idx in layers:
            layer.skip_linear.reset_parameters()  # the layer runs without a map; the fitted one is added below
        stats, inputs, skipped_of = SkippedUpdateStats(), [], []
        for run in runs:
            x, mask, input_pos = run["h"], run["mask"], run["input_pos"]
            if idx in routing_layers:  # as the decoder calls a routed (or SDT Decision) layer
                view = run["ctx"].for_layer(idx, x.device, run["layout"])
                run["h"] = layer(x, mask=mask, input_pos=input_pos, routing=view)
                run["ctx"].absorb(idx, view)
            else:
                run["h"] = layer(x, mask=mask, input_pos=input_pos)
            if idx not in layers:
                continue
            skipped = (~run["ctx"].layers[idx].selected_mask if isinstance(layer, RoutedSelfAttentionLayer)
                       else torch.ones_like(run["valid"]))
            real = skipped & run["valid"]
            update = _dense_forward(layer, x, mask, input_pos) - x
            stats.add(idx, update[real], layer.skip_linear.normalise(x[real]))
            inputs.append(x)
            skipped_of.append(skipped)
        if idx not in layers or idx not in stats.gram or stats.counts[idx].item() == 0:
            continue
        solution = stats.ridge_solution(idx, ridge)  # [d+1, d]: Wᵀ over b
        proj = layer.skip_linear.proj
        proj.weight.copy_(solution[:-1].T.to(proj.weight.dtype))
        proj.bias.copy_(solution[-1].to(proj.bias.dtype))
        # The layer ran with its map at zero; its output with the fitted map adds the map to the tokens it skips.
        for run, x, skipped in zip(runs, inputs, skipped_of):
            run["h"] = run["h"] + layer.skip_linear(x) * skipped[..., None].to(run["h"].dtype)
        report[idx] = {"tokens": float(stats.counts[idx]), "explained": stats.explained(idx, solution)}
    return report
