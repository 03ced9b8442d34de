"""torchtune's stock ``generate`` recipe, then the fraction of tokens each routed layer executed.

    tune run torchtune_dtf/recipes/routed_generate.py --config configs/generate/stt_qwen0_5b.yaml

It runs torchtune's own ``InferenceRecipe`` (the class ``tune run generate`` runs, loaded from the same
file; nothing of it is copied) with the same config, so the output is the stock one, and then logs

    executed fraction per routed layer: 1: 0.1579, 3: 0.5789; mean 0.3684
    executed/seen tokens per routed layer (student routing): 1: 3/19, 3: 11/19; counted: ...

(``configs/tiny/generate_stt.yaml`` on the tests' tiny checkpoint), read from the routed layers' student
counters (:meth:`RoutedTransformerDecoder.executed_fractions`).

``compile: True`` in the config decodes with one compiled step over static KV buffers
(:func:`torchtune_dtf.training.compile.compiled_decode_step`, CUDA graphs on a GPU): this recipe's private
copy of the stock module gets a ``generation`` whose ``generate`` passes that step as the stock
``custom_generate_next_token``. The prompt's prefill runs eager, as in the stock recipe.
The counters are zeroed after setup, so they hold exactly this generation: the prompt's tokens (prefill)
and one token per decode step; the last generated token is never fed back. The stock recipe decodes one
unpadded prompt, so no padding is counted. With a ``quantizer`` the stock recipe first runs a two-token
warm-up generation, which is counted too.
"""

import sys
from types import ModuleType
from typing import Callable

from omegaconf import DictConfig
from torchtune import config, generation, utils

from torchtune_dtf.recipes.stock import load_stock_recipe, log_config_if_asked, run_counting_routing
from torchtune_dtf.training.compile import compiled_decode_step

COUNTED = (
    "prompt tokens + one per decode step (the last generated token is never fed back); "
    "with a quantizer, the stock recipe's 2-token warm-up too"
)


class _GenerationWithStep(ModuleType):
    """``torchtune.generation`` whose ``generate`` decodes with ``step`` unless the caller passes its own."""

    def __init__(self, step: Callable) -> None:
        super().__init__("torchtune_dtf._generation_with_compiled_step")
        self._step = step

    def __getattr__(self, name):
        return getattr(generation, name)

    def generate(self, *args, custom_generate_next_token=None, **kwargs):
        return generation.generate(*args, custom_generate_next_token=custom_generate_next_token or self._step, **kwargs)


@config.parse
def main(cfg: DictConfig) -> None:
    log_config_if_asked("RoutedInferenceRecipe (stock InferenceRecipe + routing counters)", cfg)
    stock = load_stock_recipe("generate")
    recipe = stock.InferenceRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    logger = utils.get_logger(cfg.get("log_level", "INFO"))
    if cfg.get("compile", False):
        stock.generation = _GenerationWithStep(compiled_decode_step(recipe._model))  # this module copy only
        logger.info("compile: True — decoding with one compiled step over static KV caches")
    # recipe._model: the stock recipe's model (it has no public accessor)
    text, _ = run_counting_routing(recipe._model, lambda: recipe.generate(cfg=cfg), COUNTED)
    logger.info(text)


if __name__ == "__main__":
    sys.exit(main())
