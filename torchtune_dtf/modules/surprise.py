"""Surprise signals and the predictive (teacher) router of SDT and STT.

Implements, per token t of one layer (paper §3.1.2 eqs. 8–9, §3.2 eqs. 11–12, §3.3.1 eqs. 13–15;
spec §4.3–4.5):

    D_st = ||Δx||² / d                      static surprise
    D_ch = ||Δx − Δx̂||² / d                 change surprise
    CE   = D_st − (D_ch − log o_ce)          expected-event criterion
    CU   = D_st − m_cu · MA(D_st)            unexpected-event criterion
    S_CE = σ(β_ce · CE),  S_CU = σ(β_cu · CU)
    g    = S_CE + S_CU − S_CE · S_CU         probabilistic OR

Numerics (docs/design.md R1). Every quantity here is computed in fp32 whatever the model dtype, and tokens are
ranked not by g but by a transform of it that does not saturate. At β = 100, σ(β·CE) rounds to 1.0 for
CE ≳ 0.17 in fp32 (and for far smaller CE in bf16): g == 1.0 for most tokens of a trained layer, and a
top-k over g would fall back to the tie rule, i.e. position order. The rank score is monotone in g:

    s = −log(1 − g) = softplus(β_ce·CE) + softplus(β_cu·CU)      (exact; linear in CE, CU for large values)
    score = s                  if s ≥ 1
            1 + log s          if s < 1   (log s from log-softplus terms, so tiny g do not underflow to 0)

so g ≥ g_th ⟺ score ≥ score(g_th), and only exactly equal scores are left to the tie rule.

o_ce and m_cu are learnable and kept positive as softplus(raw); raw is initialised so that
softplus(raw) equals the configured init exactly (docs/design.md §3.2). β_ce and β_cu are scheduled by the
trainer and passed in on every call (docs/design.md §3.1); they are never parameters.
"""

import math
from dataclasses import dataclass

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from torchtune_dtf.modules.routing_module import RoutingModule
from torchtune_dtf.modules.selection import sequence_bounds


def static_surprise(delta: torch.Tensor) -> torch.Tensor:
    """D_st = ||Δx||²/d in fp32. ``[b, s, d]`` → ``[b, s]``."""
    return delta.float().pow(2).mean(dim=-1)


def change_surprise(delta: torch.Tensor, predicted_delta: torch.Tensor) -> torch.Tensor:
    """D_ch = ||Δx − Δx̂||²/d in fp32. ``[b, s, d]`` × 2 → ``[b, s]``."""
    return (delta.float() - predicted_delta.float()).pow(2).mean(dim=-1)


def causal_moving_average(
    values: torch.Tensor, window: int, starts: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Causal moving average over the last ``window`` tokens of each sequence, current token included.

    MA_t = mean(values[max(start_t, t − window + 1) : t + 1]) where start_t is the first token of t's
    sequence: the first tokens average over the history they have, and the average restarts with every
    sequence (spec §4.4, §9), including every packed document (docs/design.md R3).

    Args:
        values (torch.Tensor): ``[b, s]``.
        window (int): τ_w ≥ 1.
        starts (Optional[torch.Tensor]): ``[b, s]`` bool, first token of each sequence in the row; None
            means one sequence per row.

    Returns:
        torch.Tensor: ``[b, s]`` fp32.
    """
    batch, seq_len = values.shape
    # fp64 running sums: differences of long fp32 prefix sums lose the small values to cancellation.
    csum = F.pad(torch.cumsum(values.double(), dim=-1), (1, 0))  # csum[:, t] = sum of values[:, :t]
    index = torch.arange(seq_len, device=values.device).expand(batch, seq_len)
    lowest = (index - window + 1).clamp(min=0)
    if starts is not None:
        lowest = torch.maximum(lowest, sequence_bounds(starts)[0])
    total = csum[:, 1:] - torch.gather(csum, 1, lowest)
    return (total / (index - lowest + 1)).float()


def _log_softplus(z: torch.Tensor) -> torch.Tensor:
    """log(softplus(z)) without underflow: softplus(z) ≈ e^z below z = −20, where log gives z back."""
    return torch.where(z < -20, z, torch.log(F.softplus(z.clamp(min=-20))))


def gate_rank_score(scaled_ce: torch.Tensor, scaled_cu: torch.Tensor) -> torch.Tensor:
    """Non-saturating rank score of g from a = β_ce·CE and b = β_cu·CU (module docstring).

    Returns ``s = softplus(a) + softplus(b) = −log(1 − g)`` where s ≥ 1 and ``1 + log s`` below, a
    continuous, strictly increasing function of g that neither rounds to a constant for large a, b (where
    g == 1.0) nor for very negative ones (where g, and s, underflow). ``[...]`` → ``[...]`` fp32.
    """
    a, b = scaled_ce.float(), scaled_cu.float()
    s = F.softplus(a) + F.softplus(b)
    log_s = torch.logaddexp(_log_softplus(a), _log_softplus(b))
    return torch.where(s >= 1, s, 1 + log_s)


def gate_threshold_score(gate_threshold: float) -> float:
    """The rank score of g = g_th: g ≥ g_th ⟺ :func:`gate_rank_score` ≥ this."""
    s = -math.log1p(-gate_threshold)
    return s if s >= 1 else 1 + math.log(s)


def inverse_softplus(value: float) -> float:
    """raw such that softplus(raw) == value (value > 0), stable for large values."""
    return value + math.log(-math.expm1(-value))


@dataclass
class SurpriseGate:
    """Per-token outputs of :class:`PredictiveRouter`, each ``[b, s]`` fp32. ``score`` ranks tokens (same
    order as g, never saturated); g is the gate and what the losses see."""

    ce: torch.Tensor
    cu: torch.Tensor
    s_ce: torch.Tensor
    s_cu: torch.Tensor
    g: torch.Tensor
    score: torch.Tensor


class PredictiveRouter(RoutingModule):
    """Turns (D_st, D_ch) into the continuous gate g with learnable o_ce, m_cu.

    Args:
        o_ce_init (float): initial prediction offset o_ce > 0.
        m_cu_init (float): initial novelty multiplier m_cu > 0.
        ma_window (int): τ_w, window of the causal moving average of D_st.
    """

    def __init__(self, o_ce_init: float, m_cu_init: float, ma_window: int) -> None:
        super().__init__()
        self.o_ce_init = o_ce_init
        self.m_cu_init = m_cu_init
        self.ma_window = ma_window
        # Shape [1] rather than a 0-dim scalar: FSDP2 shards parameters along dim 0.
        self.o_ce_raw = nn.Parameter(torch.empty(1))
        self.m_cu_raw = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.o_ce_raw.fill_(inverse_softplus(self.o_ce_init))
            self.m_cu_raw.fill_(inverse_softplus(self.m_cu_init))

    @property
    def o_ce(self) -> torch.Tensor:
        return F.softplus(self.o_ce_raw)

    @property
    def m_cu(self) -> torch.Tensor:
        return F.softplus(self.m_cu_raw)

    def forward(
        self,
        d_st: torch.Tensor,
        d_ch: torch.Tensor,
        beta_ce: float,
        beta_cu: float,
        starts: Optional[torch.Tensor] = None,
    ) -> SurpriseGate:
        """
        Args:
            d_st (torch.Tensor): static surprise ``[b, s]``.
            d_ch (torch.Tensor): change surprise ``[b, s]``.
            beta_ce (float or 0-dim tensor): inverse temperature of CE, supplied by the trainer.
            beta_cu (float or 0-dim tensor): inverse temperature of CU, supplied by the trainer.
            starts (Optional[torch.Tensor]): ``[b, s]`` bool, first token of each sequence (the moving
                average restarts there); None means one sequence per row.

        Returns:
            SurpriseGate: CE, CU, S_CE, S_CU, g and the rank score, each ``[b, s]`` fp32.
        """
        d_st, d_ch = d_st.float(), d_ch.float()
        ce = d_st - (d_ch - torch.log(self.o_ce.float()))
        cu = d_st - self.m_cu.float() * causal_moving_average(d_st, self.ma_window, starts)
        scaled_ce, scaled_cu = beta_ce * ce, beta_cu * cu
        s_ce = torch.sigmoid(scaled_ce)
        s_cu = torch.sigmoid(scaled_cu)
        g = s_ce + s_cu - s_ce * s_cu
        score = gate_rank_score(scaled_ce.detach(), scaled_cu.detach())
        return SurpriseGate(ce=ce, cu=cu, s_ce=s_ce, s_cu=s_cu, g=g, score=score)
