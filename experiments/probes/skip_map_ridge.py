"""Probe: how much data and how much shrinkage should the skip linear maps start from?

``skip_update: linear`` starts each map at the ridge regression of the block's true update on the normalised inputs
of the tokens it stands in for (:func:`~torchtune_dtf.training.skip_bias_init.fit_skip_linear_maps`), on the first
``skip_bias_init.batches`` training batches with ``λ = skip_bias_init.ridge``. The quickstart's recipe fits on 12
batches (≈ 12k tokens for a dropped layer, half that for a routed one) at λ = 0.01, against ``d + 1 = 577`` unknowns
per output feature of SmolLM2-135M: about 20 tokens per unknown, so a fit that generalises worse than it fits is
possible, and neither value was ever swept.

This sets the recipe up once (:class:`~torchtune_dtf.recipes.routed_finetune.RoutedFinetuneRecipe`, the config's own
model, data and validation windows) and, for each (batches, λ), refits every map from scratch and scores the model
*before any training step* on the validation windows in teacher mode (the routing the first training steps use) and
student mode. It answers whether the start can be improved, not what 20 steps make of it; a setting that moves the
step-0 loss by more than the noise would then be trained as the quickstart trains.

    python -m experiments.probes.skip_map_ridge --config configs/quickstart/recommended_0_81_linear_smollm2.yaml \\
        --batches 12 48 --ridges 0.01 100 1000 10000 --out experiments/probes/skip_map_ridge.json [key=value ...]

(The result file is rewritten after every setting, so a sweep stopped early keeps what it measured. What it found:
``skip_map_ridge.md``.)
"""

import argparse
import json
import time
from typing import Any, Callable, Dict, List

import torch
from omegaconf import OmegaConf

from torchtune_dtf.recipes.routed_finetune import RoutedFinetuneRecipe
from torchtune_dtf.recipes.stock import merge_overrides
from torchtune_dtf.training.skip_bias_init import fit_skip_linear_maps


def sweep(recipe: RoutedFinetuneRecipe, batch_counts: List[int], ridges: List[float],
          record: Callable[[List[Dict[str, Any]]], None]) -> List[Dict[str, Any]]:
    """Refit every skip map for each (batches, λ) and validate the untrained model; one row per setting, each
    passed to ``record`` with the rows before it as soon as it is measured."""
    rows = []
    for count in batch_counts:
        batches = recipe._first_training_batches(count)
        if len(batches) < count:
            raise ValueError(f"the training set has {len(batches)} batches, fewer than {count}")
        for ridge in ridges:
            start = time.perf_counter()
            report = fit_skip_linear_maps(recipe._model, batches, lambda: recipe._routing_context("teacher"), ridge)
            scores = recipe.validate()
            rows.append({
                "batches": count, "ridge": ridge,
                "val_teacher": scores["val/lm_loss_teacher"], "val_student": scores["val/lm_loss_student"],
                "explained_in_fit": {str(i): r["explained"] for i, r in report.items()},
                "seconds": time.perf_counter() - start,
            })
            print(f"batches {count:3d}  ridge {ridge:8g}  teacher {rows[-1]['val_teacher']:.4f}  "
                  f"student {rows[-1]['val_student']:.4f}  ({rows[-1]['seconds']:.0f} s)", flush=True)
            record(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--batches", type=int, nargs="+", required=True)
    parser.add_argument("--ridges", type=float, nargs="+", required=True)
    parser.add_argument("--out", required=True, help="the result JSON")
    args, overrides = parser.parse_known_args()
    cfg = merge_overrides(OmegaConf.to_container(OmegaConf.load(args.config)), overrides)  # as `tune run` merges
    if cfg.model.get("skip_update") != "linear":
        raise ValueError(f"{args.config}: model.skip_update is {cfg.model.get('skip_update')!r}; the probe needs 'linear'")
    torch.manual_seed(int(cfg.seed))
    recipe = RoutedFinetuneRecipe(cfg=cfg)
    recipe.setup(cfg=cfg)  # fits the maps once with the config's values; the sweep refits them
    header = {"config": args.config, "overrides": overrides, "validation_batches": recipe._val_max_batches,
              "batch_size": int(cfg.batch_size)}

    def record(rows: List[Dict[str, Any]]) -> None:
        with open(args.out, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=1)

    sweep(recipe, args.batches, args.ridges, record)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
