"""Token routers that score tokens causally, before a block runs.

* :class:`MoDRouter` — Mixture-of-Depths router r_t = w·x_t (Raposo et al. 2024; paper eq. 4). Its scores
  pick the teacher top-k in training and σ(r_t) scales the selected tokens' updates (docs/design.md §3.5).
* :class:`CausalRouter` — the student (spec §4.7): a small MLP on RMSNorm(x_t), or on
  [RMSNorm(x_t) ‖ RMSNorm(x_{t−1})] with x_0 = 0, trained with BCE against the teacher mask.
  Its inputs are detached by the caller so the student never pulls on the backbone (docs/design.md §3.4, §3.8).
"""

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import RMSNorm

from torchtune_dtf.modules.routing_module import RoutingModule


@torch.library.custom_op("torchtune_dtf::carried_copy", mutates_args=())
def carried_copy(carried: torch.Tensor) -> torch.Tensor:
    """A copy of the term a cache carries, made by an operator inductor does not fuse (compiled code only).

    Why: a decode step reads the carried term and overwrites it with its own last token's term in the same
    graph. On the CPU, inductor (torch 2.13, still on 2.14) fuses the reader and the write into one outer loop
    with the RMSNorm's reduction and then looks up the write's ordering-only dependency as a read, failing with
    ``KeyError: 'bufN'`` (pytorch/pytorch#188228): the papers' STT compiled at decode batch 8 hit it. Reading the
    term through this opaque copy keeps the write out of that fused loop. Routed layers read through it only where one
    compiled graph reads and overwrites the term (:meth:`RoutedSelfAttentionLayer.student_logits_and_carry`); eager
    code does not call it.
    """
    return carried.clone()


@carried_copy.register_fake
def _(carried: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(carried)


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without calling the operator when ``t`` already has the dtype (``to`` would return ``t``
    itself): the router runs on one token per layer and decode step, where each operator call costs more than
    the arithmetic."""
    return t if t.dtype == dtype else t.to(dtype)


def previous_token_states(
    x: torch.Tensor, starts: torch.Tensor, carried: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x_{t−1} for every token, zero where the token starts its sequence.

    Args:
        x (torch.Tensor): ``[b, s, d]`` states of the current chunk.
        starts (torch.Tensor): ``[b, s]`` bool, True where a token has no predecessor: position 0, the
            first token of a packed document, a left pad and the first real token after left padding.
        carried (Optional[torch.Tensor]): ``[b, d]`` state of the token before this chunk (decoding);
            zeros when None.

    Returns:
        torch.Tensor: ``[b, s, d]``.
    """
    first = torch.zeros_like(x[:, :1]) if carried is None else carried[:, None].to(x.dtype)
    previous = torch.cat([first, x[:, :-1]], dim=1)
    return previous * (~starts)[..., None].to(x.dtype)


class MoDRouter(RoutingModule):
    """Linear router r_t = w·x_t. ``[b, s, d]`` → ``[b, s]`` fp32 logits.

    The product is taken in fp32: bf16 logits keep 8 significant bits, so a top-k over them would be
    decided by ties (position order) for many tokens (docs/design.md R1)."""

    def __init__(self, embed_dim: int, init_std: float) -> None:
        super().__init__()
        self.init_std = init_std
        self.proj = nn.Linear(embed_dim, 1, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, mean=0.0, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.proj.weight.float()).squeeze(-1)


class CausalRouter(RoutingModule):
    """Student router: RMSNorm input(s) → Linear → SiLU → Linear → one logit per token.

    Args:
        embed_dim (int): model width d.
        hidden_dim (int): width of the hidden layer.
        use_previous_token (bool): if True the input is [RMSNorm(x_t) ‖ RMSNorm(x_{t−1})] (2d features),
            otherwise RMSNorm(x_t) (d features).
        norm_eps (float): RMSNorm epsilon.
        init_std (float): std of the normal initialisation of both linear layers (biases start at 0).
    """

    def __init__(
        self, embed_dim: int, hidden_dim: int, use_previous_token: bool, norm_eps: float, init_std: float
    ) -> None:
        super().__init__()
        self.use_previous_token = use_previous_token
        self.init_std = init_std
        self.norm = RMSNorm(embed_dim, eps=norm_eps)
        in_dim = 2 * embed_dim if use_previous_token else embed_dim
        self.hidden = nn.Linear(in_dim, hidden_dim)
        self.out = nn.Linear(hidden_dim, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.norm.scale)
        for layer in (self.hidden, self.out):
            nn.init.normal_(layer.weight, mean=0.0, std=self.init_std)
            nn.init.zeros_(layer.bias)

    def _normed_projection(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm(x)·Wᵀ ``[..., rows]`` for ``x [..., d]``, where W ``[rows, d]`` is :meth:`_stacked_weight`.

        RMSNorm(x) = (x / rms(x)) ⊙ scale, so the product equals (x·(W ⊙ scale)ᵀ) / rms(x) = ((x ⊙ scale)·Wᵀ) /
        rms(x): the per-token 1/rms is applied to the narrow result, never to a normalised ``[..., d]`` copy, and
        the per-feature scale goes to whichever operand is smaller. A prefill (and any forward that trains the
        router) folds it into the weight; a decode step (a token or a few) scales its input instead, so it
        writes d values, not a ``[rows, d]`` weight per routed layer and step (compiled, where nothing derived
        can be kept across calls, the folded weight was most of the router's time at batch 1).
        """
        weight = self._stacked_weight()
        scale = self.norm.scale.to(weight.dtype)
        inv_rms = torch.rsqrt(_as_dtype(x, torch.float32).pow(2).mean(-1, keepdim=True) + self.norm.eps)
        # With the router training, the folded weight is also the cheaper backward: the scale's gradient then
        # comes from the weight's, where a scaled input would need one more product (the gradient of x ⊙ scale).
        training = torch.is_grad_enabled() and self.norm.scale.requires_grad
        if x.numel() // x.shape[-1] <= weight.shape[0] and not training:
            projected = F.linear(x * scale.to(x.dtype), weight)
        else:
            projected = F.linear(x, weight * scale)
        return projected * _as_dtype(inv_rms, x.dtype)

    def _stacked_weight(self) -> torch.Tensor:
        """The hidden layer's weight as ``[rows, d]``: ``W [h, d]`` for one input; with the previous token the
        ``[h, 2d]`` = ``[W_c | W_p]`` weight viewed (no copy) as ``[2h, d]`` with rows interleaved, W_c's j-th
        row at 2j and W_p's at 2j + 1, so every token goes through both halves in one product: its own term
        (even columns of the result) and the term it hands the token after it (odd columns)."""
        weight = self.hidden.weight
        return weight.view(-1, weight.shape[1] // 2) if self.use_previous_token else weight

    @property
    def carry_dim(self) -> int:
        """Width of the term a chunk hands the next chunk's first token (:meth:`forward`'s ``carried``): the
        hidden width when the router reads the previous token, 0 when it does not."""
        return self.hidden.out_features if self.use_previous_token else 0

    def forward(
        self,
        x: torch.Tensor,
        starts: Optional[torch.Tensor] = None,
        carried: Optional[torch.Tensor] = None,
        *,
        return_carried: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """
        Args:
            x (torch.Tensor): ``[b, s, d]`` layer inputs x_t^(l−1).
            starts (Optional[torch.Tensor]): ``[b, s]`` bool, True where a token has no predecessor
                (x_{t−1} = 0; see :func:`previous_token_states`). Required when ``use_previous_token``.
            carried (Optional[torch.Tensor]): ``[b, h]`` the term W_p·RMSNorm(x_{t−1}) of the token just before
                this chunk, as the call on the previous chunk returned it (decoding with a cache); None at the
                start of a sequence. Carrying the term instead of the input spares each decode step a second
                normed projection.
            return_carried (bool): also return the term this chunk's last token hands the next chunk.

        Returns:
            torch.Tensor: ``[b, s]`` fp32 logits r̃_t (the student's threshold and top-k compare these); with
            ``return_carried`` the pair (logits, ``[b, h]`` term of the last token, or None without the previous
            token's input).
        """
        if not self.use_previous_token:
            logits = self._logit(self._normed_projection(x) + self.hidden.bias)
            return (logits, None) if return_carried else logits
        if starts is None:
            raise ValueError("CausalRouter(use_previous_token=True) needs to know where each sequence starts")
        # hidden([n_t ‖ n_{t−1}]) = W_c·n_t + b + W_p·n_{t−1}. RMSNorm is per token, so every token is
        # projected once through [W_c; W_p] and its W_p part is shifted one token later, instead of
        # normalising and concatenating a shifted [b, s, 2d] copy of the input.
        both = self._normed_projection(x)
        current, to_next = both[..., 0::2], both[..., 1::2]  # to_next: token t's term for token t+1
        first = torch.zeros_like(to_next[:, :1]) if carried is None else carried[:, None].to(x.dtype)
        # One token (a decode step): its predecessor's term is the carried one; no copy through an empty shift.
        from_previous = first if x.shape[1] == 1 else torch.cat([first, to_next[:, :-1]], dim=1)
        # RMSNorm(0) = 0, so a token that starts a sequence (document, or after left padding) gets nothing.
        hidden = current + self.hidden.bias + from_previous * (~starts)[..., None].to(current.dtype)
        logits = self._logit(hidden)
        return (logits, to_next[:, -1]) if return_carried else logits

    def _logit(self, hidden: torch.Tensor) -> torch.Tensor:
        # The last projection in fp32, so logits of a bf16 model do not tie in 8 significant bits.
        fp32 = torch.float32
        weight, bias = _as_dtype(self.out.weight, fp32), _as_dtype(self.out.bias, fp32)
        return F.linear(_as_dtype(F.silu(hidden), fp32), weight, bias).squeeze(-1)
