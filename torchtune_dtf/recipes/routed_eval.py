"""torchtune's stock ``eleuther_eval`` recipe, then the fraction of tokens each routed layer executed.

    tune run torchtune_dtf/recipes/routed_eval.py --config configs/eval/stt_qwen0_5b.yaml

It runs torchtune's own ``EleutherEvalRecipe`` (the class ``tune run eleuther_eval`` runs, loaded from
the same file; nothing of it is copied) with the same config, so the lm-eval results table is the stock
one. After it, the recipe logs the executed fraction per routed layer (and the mean) over every forward
of the evaluation, read from the routed layers' student counters
(:meth:`RoutedTransformerDecoder.executed_fractions`), and writes them with lm-eval's results to
``{output_dir}/routed_eval_results.json``.

What the counts include: every token the stock wrapper feeds the model, and the layers cannot tell
padding apart from text: lm-eval's right padding of loglikelihood batches, the left padding of
generation batches, the rows of eos tokens the wrapper adds to fill a short generation batch, and the
decode steps of rows that already stopped (torchtune's ``generate`` decodes until every row stops or
``max_gen_toks``). So these fractions describe the compute the routed layers spent in this evaluation,
padding included; per-token routing on clean text is what ``torchtune_dtf.evaluation.routing_report``
measures.

``compile: True`` in the config compiles every decoder layer (:func:`torchtune_dtf.training.compile.compile_layers`)
with static selective caches before the evaluation; the stock recipe has no such key and ignores it.

The results reach the JSON through a hook on this recipe's private copy of the stock module: its
global ``evaluate`` (lm-eval's) is wrapped to keep the returned dict, which the stock recipe only logs.
"""

import json
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from torchtune import config

from torchtune_dtf.recipes.stock import load_stock_recipe, log_config_if_asked, run_counting_routing
from torchtune_dtf.training.compile import compile_layers

RESULTS_FILE = "routed_eval_results.json"
COUNTED = (
    "every token of every forward, padding included (loglikelihood right padding, generation left padding "
    "and filler rows, decode steps of rows that already stopped)"
)


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    log_config_if_asked("RoutedEleutherEvalRecipe (stock EleutherEvalRecipe + routing counters)", cfg)
    stock = load_stock_recipe("eleuther_eval")
    outputs = []
    lm_eval_evaluate = stock.evaluate

    def evaluate_keeping_results(*args, **kwargs):
        output = lm_eval_evaluate(*args, **kwargs)
        outputs.append(output)
        return output

    stock.evaluate = evaluate_keeping_results  # this module object is private to this call
    recipe = stock.EleutherEvalRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)
    if cfg.get("compile", False):
        model = recipe.eleuther_model_wrapper.model
        if hasattr(model, "use_static_kv_caches"):
            model.use_static_kv_caches()
        compile_layers(model)
    text, summary = run_counting_routing(recipe.eleuther_model_wrapper.model, recipe.evaluate, COUNTED)
    recipe.logger.info(text)
    if cfg.get("output_dir") and outputs and outputs[-1] is not None:
        path = Path(cfg.output_dir) / RESULTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "config": OmegaConf.to_container(cfg, resolve=True),
            "results": outputs[-1].get("results"),
            "routing": summary,
        }
        # lm-eval's results hold floats and "N/A" strings; default=str covers anything else it adds.
        path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
        recipe.logger.info(f"Results and executed fractions written to {path}")


if __name__ == "__main__":
    sys.exit(recipe_main())
