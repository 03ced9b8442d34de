"""Surprise signals and the predictive (teacher) router of SDT and STT.

Implements, per token t of one layer (paper §3.1.2 eqs. 8–9, §3.2 eqs. 11–12, §3.3.1 eqs. 13–15;
spec §4.3–4.5):

    D_st = ||Δx||² / d                      static surprise
    D_ch = ||Δx − Δx̂||² / d                 change surprise
    CE   = D_st − (D_ch − log o_ce)          expected-event criterion
    CU   = D_st − m_cu · MA(D_st)            unexpected-event criterion
    S_CE = σ(β_ce · CE),  S_CU = σ(β_cu · CU)
    g    = S_CE + S_CU − S_CE · S_CU         probabilistic OR

o_ce and m_cu are learnable and kept positive as softplus(raw); raw is initialised so that
softplus(raw) equals the configured init exactly (DESIGN §3.2). β_ce and β_cu are scheduled by the
trainer and passed in on every call (DESIGN §3.1); they are never parameters.
"""

import math
from dataclasses import dataclass

from typing import List

import torch
import torch.nn.functional as F
from torch import nn


def static_surprise(delta: torch.Tensor) -> torch.Tensor:
    """D_st = ||Δx||²/d. ``[b, s, d]`` → ``[b, s]``."""
    return delta.pow(2).mean(dim=-1)


def change_surprise(delta: torch.Tensor, predicted_delta: torch.Tensor) -> torch.Tensor:
    """D_ch = ||Δx − Δx̂||²/d. ``[b, s, d]`` × 2 → ``[b, s]``."""
    return (delta - predicted_delta).pow(2).mean(dim=-1)


def causal_moving_average(values: torch.Tensor, window: int) -> torch.Tensor:
    """Causal moving average over the last ``window`` tokens of each row, current token included.

    MA_t = mean(values[max(0, t − window + 1) : t + 1]); the first tokens average over the history they
    have, so the average restarts with every sequence (spec §4.4, §9).

    Args:
        values (torch.Tensor): ``[b, s]``.
        window (int): τ_w ≥ 1.

    Returns:
        torch.Tensor: ``[b, s]``.
    """
    seq_len = values.shape[-1]
    csum = torch.cumsum(values.float(), dim=-1)
    shifted = F.pad(csum, (window, 0))[..., :seq_len]  # csum[t - window], zero before the start
    counts = torch.arange(1, seq_len + 1, device=values.device).clamp(max=window)
    return ((csum - shifted) / counts).to(values.dtype)


def inverse_softplus(value: float) -> float:
    """raw such that softplus(raw) == value (value > 0), stable for large values."""
    return value + math.log(-math.expm1(-value))


@dataclass
class SurpriseGate:
    """Per-token outputs of :class:`PredictiveRouter`, each ``[b, s]``."""

    ce: torch.Tensor
    cu: torch.Tensor
    s_ce: torch.Tensor
    s_cu: torch.Tensor
    g: torch.Tensor


class PredictiveRouter(nn.Module):
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

    def adapter_params(self) -> List[str]:
        """Every routing parameter is trainable in LoRA models (torchtune's ``get_adapter_params`` hook)."""
        return [name for name, _ in self.named_parameters()]

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
        self, d_st: torch.Tensor, d_ch: torch.Tensor, beta_ce: float, beta_cu: float
    ) -> SurpriseGate:
        """
        Args:
            d_st (torch.Tensor): static surprise ``[b, s]``.
            d_ch (torch.Tensor): change surprise ``[b, s]``.
            beta_ce (float): inverse temperature of CE, supplied by the trainer.
            beta_cu (float): inverse temperature of CU, supplied by the trainer.

        Returns:
            SurpriseGate: CE, CU, S_CE, S_CU and g, each ``[b, s]``.
        """
        ce = d_st - (d_ch - torch.log(self.o_ce))
        cu = d_st - self.m_cu * causal_moving_average(d_st, self.ma_window)
        s_ce = torch.sigmoid(beta_ce * ce)
        s_cu = torch.sigmoid(beta_cu * cu)
        g = s_ce + s_cu - s_ce * s_cu
        return SurpriseGate(ce=ce, cu=cu, s_ce=s_ce, s_cu=s_cu, g=g)
