"""Token routers that score tokens causally, before a block runs.

* :class:`MoDRouter` — Mixture-of-Depths router r_t = w·x_t (Raposo et al. 2024; paper eq. 4). Its scores
  pick the teacher top-k in training and σ(r_t) scales the selected tokens' updates (DESIGN §3.5).
* :class:`CausalRouter` — the student (spec §4.7): a small MLP on RMSNorm(x_t), or on
  [RMSNorm(x_t) ‖ RMSNorm(x_{t−1})] with x_0 = 0, trained with BCE against the teacher mask.
  Its inputs are detached by the caller so the student never pulls on the backbone (DESIGN §3.4, §3.8).
"""

from typing import List, Optional

import torch
from torch import nn
from torchtune.modules import RMSNorm


def previous_token_states(
    x: torch.Tensor, positions: torch.Tensor, carried: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """x_{t−1} for every token, zero where the token starts its sequence.

    Args:
        x (torch.Tensor): ``[b, s, d]`` states of the current chunk.
        positions (torch.Tensor): ``[b, s]`` position ids; a token at position 0 has no predecessor
            (this also covers left padding, whose first real token has position 0).
        carried (Optional[torch.Tensor]): ``[b, d]`` state of the token before this chunk (decoding);
            zeros when None.

    Returns:
        torch.Tensor: ``[b, s, d]``.
    """
    first = torch.zeros_like(x[:, :1]) if carried is None else carried[:, None].to(x.dtype)
    previous = torch.cat([first, x[:, :-1]], dim=1)
    return previous * (positions > 0)[..., None].to(x.dtype)


class MoDRouter(nn.Module):
    """Linear router r_t = w·x_t. ``[b, s, d]`` → ``[b, s]`` logits."""

    def __init__(self, embed_dim: int, init_std: float) -> None:
        super().__init__()
        self.init_std = init_std
        self.proj = nn.Linear(embed_dim, 1, bias=False)
        self.reset_parameters()

    def adapter_params(self) -> List[str]:
        """Every routing parameter is trainable in LoRA models (torchtune's ``get_adapter_params`` hook)."""
        return [name for name, _ in self.named_parameters()]

    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, mean=0.0, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).squeeze(-1)


class CausalRouter(nn.Module):
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

    def adapter_params(self) -> List[str]:
        """Every routing parameter is trainable in LoRA models (torchtune's ``get_adapter_params`` hook)."""
        return [name for name, _ in self.named_parameters()]

    def reset_parameters(self) -> None:
        nn.init.ones_(self.norm.scale)
        for layer in (self.hidden, self.out):
            nn.init.normal_(layer.weight, mean=0.0, std=self.init_std)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, previous: Optional[torch.Tensor] = None) -> torch.Tensor:
        """
        Args:
            x (torch.Tensor): ``[b, s, d]`` layer inputs x_t^(l−1).
            previous (Optional[torch.Tensor]): ``[b, s, d]`` x_{t−1}^(l−1) (zeros at sequence starts);
                required when ``use_previous_token``.

        Returns:
            torch.Tensor: ``[b, s]`` logits r̃_t.
        """
        features = self.norm(x)
        if self.use_previous_token:
            if previous is None:
                raise ValueError("CausalRouter(use_previous_token=True) needs the previous-token states")
            # RMSNorm of an all-zero state is zero, so x_0 = 0 stays 0.
            features = torch.cat([features, self.norm(previous)], dim=-1)
        return self.out(nn.functional.silu(self.hidden(features))).squeeze(-1)
