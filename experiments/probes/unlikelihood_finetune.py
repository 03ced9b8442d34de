"""Probe: does token-level unlikelihood training stop the quickstart's routed model from repeating itself?

Token-level unlikelihood (Welleck et al., 2019, "Neural text generation with unlikelihood training", §4) adds to the
next-token loss, at each position t, a penalty on the probability of every distinct token already in the context that
is not the target: ``−Σ_{c ∈ C_t} log(1 − p(c | x_<t))`` with ``C_t = {x_1 … x_t} \\ {x_{t+1}}``, weighted by α.
It aims at repetition itself, which nothing tried in ``greedy_remedies.md`` did. This is the routed recipe
(:class:`~torchtune_dtf.recipes.routed_finetune.RoutedFinetuneRecipe`) with that term added to the objective of
each training step, a probe and not a recipe option: α comes from ``UNLIKELIHOOD_WEIGHT`` (required), the term is
logged as ``loss/unlikelihood``, and validation is unchanged.

    UNLIKELIHOOD_WEIGHT=1.0 python -m experiments.probes.unlikelihood_finetune --config CONFIG key=value ...

(``bash experiments/probes/greedy_remedies.sh`` trains and measures it beside the other remedies.)
"""

import os
from typing import Dict, List, Union

import torch
from omegaconf import DictConfig

from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.recipes.stock import parse


def token_unlikelihood(logits: Union[torch.Tensor, List[torch.Tensor]], labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Mean over target positions of ``−Σ_{c ∈ C_t} log(1 − p_t(c))``, ``C_t`` the distinct earlier targets of the
    same row (the context tokens after the first) other than the target at t.

    Args:
        logits: ``[b, s, v]``, or chunks of it along s (torchtune's chunked output).
        labels (torch.Tensor): ``[b, s]`` next-token targets aligned with the logits (``ignore_index``: none).
        ignore_index (int): label of positions without a target.

    Returns:
        A float32 scalar.
    """
    if not isinstance(logits, torch.Tensor):
        logits = torch.cat(logits, dim=1)
    seq_len = labels.shape[1]
    valid = labels != ignore_index
    earlier = torch.ones(seq_len, seq_len, dtype=torch.bool, device=labels.device).tril(-1)  # [t, j]: j < t
    same = labels.unsqueeze(2) == labels.unsqueeze(1)  # [b, t, j]: target t equals target j
    # Count each token once: j is a candidate only where no earlier valid target equals it.
    repeat_of_earlier = (same & earlier & valid.unsqueeze(1)).any(dim=2)  # [b, j]
    candidate = earlier & (valid & ~repeat_of_earlier).unsqueeze(1) & ~same  # [b, t, j]
    probs = torch.softmax(logits.float(), dim=-1)
    p_candidate = probs.gather(-1, labels.clamp(min=0).unsqueeze(1).expand(-1, seq_len, -1))  # [b, t, j]: p_t(x_j)
    penalty = -(torch.log1p(-p_candidate.clamp(max=1 - 1e-5)) * candidate).sum(-1)  # [b, t]
    return (penalty * valid).sum() / valid.sum().clamp(min=1)


class _RememberingLoss:
    """The recipe's loss function, keeping the logits and labels of its last call (the training step's)."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn, self.last = loss_fn, None

    def __call__(self, logits, labels):
        self.last = (logits, labels)
        return self.loss_fn(logits, labels)

    def __getattr__(self, name):
        return getattr(self.loss_fn, name)


class UnlikelihoodFinetuneRecipe(RoutedFinetuneRecipe):
    """The routed recipe whose training objective gains ``α · token_unlikelihood`` (α from the environment)."""

    def setup(self, cfg: DictConfig) -> None:
        if "UNLIKELIHOOD_WEIGHT" not in os.environ:
            raise ValueError("UNLIKELIHOOD_WEIGHT (α of the unlikelihood term) is not set")
        self._unlikelihood_weight = float(os.environ["UNLIKELIHOOD_WEIGHT"])
        super().setup(cfg)
        self._loss_fn = _RememberingLoss(self._loss_fn)

    def _total_loss(self, batch: Dict[str, torch.Tensor]):
        loss, parts, routing = super()._total_loss(batch)
        logits, labels = self._loss_fn.last
        unlikelihood = token_unlikelihood(logits, labels, self._loss_fn.ignore_index)
        parts["unlikelihood"] = unlikelihood.detach()
        return loss + self._unlikelihood_weight * unlikelihood, parts, routing


@parse
def main(cfg: DictConfig) -> None:
    recipe = UnlikelihoodFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    main()
