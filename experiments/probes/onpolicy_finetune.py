"""Probe: does distillation on the routed student's own greedy continuations stop it from repeating itself?

The quickstart's routed student loops under greedy decoding more than the dense control does
(``greedy_remedies.md``). It is trained only on the corpus's text (teacher forcing), never on the text it writes
itself, where a loop, once started, is never corrected: the exposure bias that on-policy distillation targets
(Agarwal et al., 2024, "On-policy distillation of language models: learning from self-generated mistakes", GKD;
Gu et al., 2024, MiniLLM). This is the routed recipe
(:class:`~torchtune_dtf.recipes.routed_finetune.RoutedFinetuneRecipe`) with one more term in each step's objective:

1. the first ``P`` tokens of each row of the micro-batch are prompts;
2. the model as deployed (student routing, window top-k of ``W`` scores, KV caches; a dense model as it is)
   continues them greedily for ``G`` tokens, without gradient;
3. the training forward (the step's own routing context) and the frozen starting model (the recipe's distillation
   teacher) read prompt + continuation, and ``λ · T²·KL(starting ‖ trained)`` over the ``G`` continuation tokens
   (:func:`~torchtune_dtf.training.routing_losses.distillation_loss`, T the config's ``distillation.temperature``)
   joins the objective; the auxiliary routing losses of that forward are not used.

The extra teacher-mode forward also feeds the routed layers' running statistics (the criterion's moving averages)
with the continuations. A probe, not a recipe option: the values come from the environment (all required),
``ON_POLICY_WEIGHT`` (λ), ``ON_POLICY_PROMPT_TOKENS`` (P), ``ON_POLICY_NEW_TOKENS`` (G) and
``ON_POLICY_STUDENT_WINDOW`` (W, the eval configs' deployed window; unused by a dense model); the term is logged as
``loss/on_policy_kl``, and validation is unchanged. A dense control gets the same frozen starting model as its
teacher even where its config distils nothing from it.

    ON_POLICY_WEIGHT=1 ON_POLICY_PROMPT_TOKENS=24 ON_POLICY_NEW_TOKENS=40 ON_POLICY_STUDENT_WINDOW=64 \\
        python -m experiments.probes.onpolicy_finetune --config CONFIG key=value ...

(``bash experiments/probes/greedy_remedies.sh`` trains and measures it beside the other remedies.)
"""

import contextlib
import os
from typing import Dict, Iterator

import torch
from omegaconf import DictConfig
from torch import nn
from torchtune import generation
from torchtune.modules.common_utils import delete_kv_caches

from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.recipes.stock import parse
from torchtune_dtf.training.routing_losses import distillation_loss

ENVIRONMENT = ("ON_POLICY_WEIGHT", "ON_POLICY_PROMPT_TOKENS", "ON_POLICY_NEW_TOKENS", "ON_POLICY_STUDENT_WINDOW")


@contextlib.contextmanager
def window_topk_students(model: nn.Module, window: int) -> Iterator[None]:
    """Every routed layer's student rule set to window top-k over ``window`` scores for the block (the eval configs'
    deployed rule, where training validates a threshold student), and restored after it."""
    layers = [m for m in model.modules() if hasattr(m, "student_routing_mode")]
    saved = [(m.student_routing_mode, m.student_window) for m in layers]
    try:
        for layer in layers:
            layer.student_routing_mode, layer.student_window = "window_topk", window
        yield
    finally:
        for layer, (mode, kept_window) in zip(layers, saved):
            layer.student_routing_mode, layer.student_window = mode, kept_window


@torch.no_grad()
def greedy_continuations(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``[b, P + new_tokens]``: ``prompts [b, P]`` and the model's greedy continuation of each (no stop token, so
    every row has the same length), decoded with KV caches that are removed again; the model's train/eval mode and
    output chunking are restored."""
    was_training, output_chunks = model.training, model.num_output_chunks
    model.eval()
    model.set_num_output_chunks(0)  # generate reads one tensor of logits, not the chunks a chunked loss trains on
    model.setup_caches(batch_size=prompts.shape[0], dtype=torch.float32,
                       decoder_max_seq_len=prompts.shape[1] + new_tokens)
    try:
        tokens, _ = generation.generate(model, prompts, max_generated_tokens=new_tokens, temperature=1.0, top_k=1)
    finally:
        delete_kv_caches(model)
        model.set_num_output_chunks(output_chunks)
        model.train(was_training)
    return tokens.clone()


def continuation_labels(tokens: torch.Tensor, prompt_tokens: int, ignore_index: int) -> torch.Tensor:
    """``[b, s]`` next-token targets of ``tokens [b, s]`` for the positions that predict a continuation token
    (``prompt_tokens − 1`` … ``s − 2``); every other position (the prompt's own next tokens, the last) is
    ``ignore_index``."""
    labels = torch.full_like(tokens, ignore_index)
    labels[:, prompt_tokens - 1 : -1] = tokens[:, prompt_tokens:]
    return labels


class OnPolicyFinetuneRecipe(RoutedFinetuneRecipe):
    """The routed recipe whose objective gains ``λ · KL(starting ‖ trained)`` on the model's own greedy
    continuations of the batch's first tokens (values from the environment)."""

    def setup(self, cfg: DictConfig) -> None:
        missing = [name for name in ENVIRONMENT if name not in os.environ]
        if missing:
            raise ValueError(f"on-policy probe: {', '.join(missing)} not set (see experiments/probes/onpolicy_finetune.py)")
        self._on_policy_weight = float(os.environ["ON_POLICY_WEIGHT"])
        self._prompt_tokens = int(os.environ["ON_POLICY_PROMPT_TOKENS"])
        self._new_tokens = int(os.environ["ON_POLICY_NEW_TOKENS"])
        self._student_window = int(os.environ["ON_POLICY_STUDENT_WINDOW"])
        if self._prompt_tokens < 1 or self._new_tokens < 1:
            raise ValueError("ON_POLICY_PROMPT_TOKENS and ON_POLICY_NEW_TOKENS must be ≥ 1")
        super().setup(cfg)
        self._on_policy_teacher = self._dense_teacher if self._dense_teacher is not None else self._setup_dense_teacher(cfg)

    def _total_loss(self, batch: Dict[str, torch.Tensor]):
        loss, parts, routing = super()._total_loss(batch)
        prompts = batch["tokens"][:, : self._prompt_tokens]
        if prompts.shape[1] < self._prompt_tokens:
            raise ValueError(f"on-policy probe: rows of {prompts.shape[1]} tokens are shorter than the prompt ({self._prompt_tokens})")
        with window_topk_students(self._model, self._student_window):
            tokens = greedy_continuations(self._model, prompts, self._new_tokens)
        ignore = self._loss_fn.ignore_index
        written = {"tokens": tokens}
        labels = continuation_labels(tokens, self._prompt_tokens, ignore)
        # The same routing the step trains with (teacher mode); its auxiliary losses stay with the corpus forward.
        logits = self._logits(self._model, written, self._routing_context("teacher"))
        with torch.no_grad():
            teacher_logits = self._logits(self._on_policy_teacher, written, None)
        kl = distillation_loss(logits, teacher_logits, labels, float(self._distillation.temperature), ignore)
        parts["on_policy_kl"] = kl.detach()
        return loss + self._on_policy_weight * kl, parts, routing


@parse
def main(cfg: DictConfig) -> None:
    recipe = OnPolicyFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    main()
