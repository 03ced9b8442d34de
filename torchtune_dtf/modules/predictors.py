"""Residual predictors: the SDT PriorFFN and the STT Transition Network (TPN).

Both predict a transformer block's residual update Δx from a single state vector:

* PriorFFN (paper §3.1.1, eq. 7): Δx̂_t = PriorFFN(x_t^(l-1)) — a spatial prior from the block's own input.
* TPN (paper §3.2, eq. 10; spec §4.2): Δx̂_t = TPN(x_{t-1}^(l)) — a temporal prior from the previous
  token's output state at the same layer (x_0 = 0).

They share one architecture (docs/design.md §3.3): input RMSNorm, then a bias-free SwiGLU MLP like Qwen's,
with intermediate width d_i = max(2, ceil(f·d)) rounded up to an even number, weights N(0, std²).
"""

import math

import torch
from torch import nn
from torchtune.modules import RMSNorm

from torchtune_dtf.modules.routing_module import RoutingModule


def predictor_width(prior_factor: float, embed_dim: int) -> int:
    """Intermediate width of a residual predictor: max(2, ceil(f·d)) rounded up to even.

    >>> predictor_width(0.0625, 896)
    56
    """
    width = max(2, math.ceil(prior_factor * embed_dim))
    return width + (width % 2)


class ResidualPredictor(RoutingModule):
    """RMSNorm → SwiGLU MLP (no biases) predicting a residual update.

    Args:
        embed_dim (int): model width d.
        hidden_dim (int): intermediate width d_i (see :func:`predictor_width`).
        norm_eps (float): RMSNorm epsilon.
        init_std (float): standard deviation of the normal initialisation of the three projections.

    Shapes: input ``[..., d]`` → output ``[..., d]``.
    """

    def __init__(self, embed_dim: int, hidden_dim: int, norm_eps: float, init_std: float) -> None:
        super().__init__()
        self.init_std = init_std
        self.norm = RMSNorm(embed_dim, eps=norm_eps)
        self.gate_proj = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, embed_dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.norm.scale)
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(proj.weight, mean=0.0, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class SkipBias(RoutingModule):
    """A learned constant update ``b ∈ R^d`` that every token skipping a routed layer receives
    (``skip_update: bias``): the cheapest forecast of the block's update, the same for every token.

    Skipping a block leaves the residual stream without the layer's average contribution, which no later
    layer can add back (Qwen's MLP and output projections have no bias). The ideal constant, before any
    training, is the mean update of the skipped tokens (``experiments/frontier/skip_bias_probe.py`` measures
    what it is worth); here it starts at zero and is learned. It costs an add per skipped token (not counted
    as FLOPs, like the residual adds) and d parameters per layer.

    Shapes: ``forward()`` → ``[d]`` (broadcasts over ``[b, s, d]``).
    """

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.update = nn.Parameter(torch.empty(embed_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.update)  # zero: the model starts as with skip_update none

    def forward(self) -> torch.Tensor:
        return self.update


def rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dimension: an RMSNorm without its scale, in ``x``'s dtype.

    Shapes: ``[..., d]`` → ``[..., d]``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class SkipLinear(RoutingModule):
    """A learned affine update computed from the token's own layer input, ``W·rms(x) + b``, that every token
    skipping a routed layer (or passing a dropped one) receives (``skip_update: linear``).

    A per-token stand-in for the block: the least-squares affine map from the block's normalised input to its
    update replaces a pruned block in ReplaceMe / LLM-Streamline. Started at that least-squares fit
    (``skip_bias_init``, :mod:`torchtune_dtf.training.skip_bias_init`, fitted layer by layer in depth order) it
    kept 0.09 nats more held-out quality than plain layer dropping after the quickstart recipe's 20 distilled
    steps, where the mean update (:class:`SkipBias`) kept 0.02 (``experiments/probes/dropped_layer_replacement.md``).
    ``rms`` is an RMSNorm without a scale (the map's ``W`` absorbs it), computed in float32. Zero-initialised,
    so an unfitted model computes what ``skip_update: none`` computes. Costs ``2·d²`` FLOPs per token it
    serves (about a tenth of a SmolLM2 block) and ``d² + d`` parameters per layer.

    Args:
        embed_dim (int): model width d.
        norm_eps (float): epsilon of the normalisation.

    Shapes: ``forward(x)``: ``[..., d]`` → ``[..., d]``.
    """

    def __init__(self, embed_dim: int, norm_eps: float) -> None:
        super().__init__()
        self.norm_eps = norm_eps
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.proj.weight)  # zero: the model starts as with skip_update none
        nn.init.zeros_(self.proj.bias)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x)`` over the last dimension, in float32 (the map's input; the fit reads it too)."""
        return rms_normalised(x.float(), self.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.normalise(x).to(self.proj.weight.dtype)).to(x.dtype)


# SDT's name for it (the papers' PriorFFN); STT's transition network is the same module with another input.
PriorFFN = ResidualPredictor
