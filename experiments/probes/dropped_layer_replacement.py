"""Probe: replace each dropped layer by a linear map fitted in closed form, instead of nothing.

Layer dropping removes a block's update ``f_l(x)`` from the residual stream. A cheap stand-in is the affine map
that best predicts that update from the block's (RMS-normalised) input on training text,

    x ← x + W·rms(x) + b,    (W, b) = argmin Σ_t ‖f_l(x_t) − W·rms(x_t) − b‖² + λ‖W‖²,

fitted per dropped layer on the dense model's own trajectory (one least-squares solve, no training), as
LLM-Streamline replaces a pruned span by a light network. It costs ``2·d·(d+1)`` FLOPs per token per layer (about
a tenth of a SmolLM2 block). Also measured: only the mean update ``b`` (the same fit with ``W = 0``), and, as a
layer-dropping point above every 5-layer arm's FLOPs, plain dropping of only the 4 least influential (``none4``).

The probe uses layer dropping alone (the quickstart recipe's five dropped layers, no routing) and the recipe's
training (distilled from the dense starting model: CE + T²·KL at T = 1, AdamW 1e-4, cosine, 2 warm-up steps,
clip 1.0, batches of 4 × 256 tokens), and scores the validation windows (the study's selection text; never the
test works). A seed picks which training windows the run reads. It answers "is this worth building into the
model?", not a recipe's claim.

    OMP_NUM_THREADS=2 .venv/bin/python -m experiments.probes.dropped_layer_replacement --steps 20 --seeds 0 1 2
"""

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torchtune import config

from experiments.frontier.oracle_probe import SkippedUpdateSums, rms_normalised
from experiments.pages import fmt_mean_std
from torchtune_dtf import closed_form
from torchtune_dtf.atomic_write import atomic_write_text
from torchtune_dtf.evaluation.routing_report import heldout_windows, load_trained
from torchtune_dtf.models.model_config import dense_model_config
from torchtune_dtf.training.routing_losses import distillation_loss

CONFIG = Path("configs/quickstart/recommended_0_81_smollm2.yaml")
OUT = Path("experiments/probes/dropped_layer_replacement.json")
SEQ_LEN = 256


class Replacement(torch.nn.Module):
    """``x + W·rms(x) + b`` for ``x`` of shape ``[b, s, d]``."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.proj(rms_normalised(hidden))


@torch.no_grad()
def fit(dense, windows: torch.Tensor, dropped: List[int], *, with_matrix: bool, ridge: float) -> torch.nn.ModuleDict:
    """Per dropped layer, the least-squares ``(W, b)`` of its update on the dense trajectory over ``windows`` (every
    token); without ``with_matrix`` only ``b``, the mean update."""
    sums = SkippedUpdateSums()
    for batch in windows.split(4):
        hidden = dense.tok_embeddings(batch)
        for index, layer in enumerate(dense.layers):
            out = layer(hidden)
            if index in dropped:
                sums.add(index, (out - hidden).flatten(0, 1), hidden.flatten(0, 1) if with_matrix else None)
            hidden = out
    maps, means = (sums.linear_maps(ridge) if with_matrix else {}), sums.means()
    modules = torch.nn.ModuleDict()
    for index in dropped:
        module = Replacement(dense.tok_embeddings.embedding_dim)
        torch.nn.init.zeros_(module.proj.weight)
        if with_matrix:
            module.proj.weight.copy_(maps[index].solution[:-1].T)
            module.proj.bias.copy_(maps[index].solution[-1])
        else:
            module.proj.bias.copy_(means[index])
        modules[str(index)] = module
    return modules


def forward(model, replacements: torch.nn.ModuleDict, dropped: List[int], tokens: torch.Tensor) -> torch.Tensor:
    hidden = model.tok_embeddings(tokens)
    for index, layer in enumerate(model.layers):
        if index in dropped:
            hidden = replacements[str(index)](hidden) if str(index) in replacements else hidden
        else:
            hidden = layer(hidden)
    return model.output(model.norm(hidden))


@torch.no_grad()
def validation_loss(model, replacements, dropped, windows: torch.Tensor) -> float:
    total = 0.0
    for batch in windows.split(4):
        logits = forward(model, replacements, dropped, batch)
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
    return total / (windows.shape[0] * (windows.shape[1] - 1))


def train(student, pretrained, replacements, dropped, windows: torch.Tensor, steps: int, lr: float) -> None:
    """The recipe's distilled fine-tune of the layer-dropped ``student`` (its dropped layers' weights unused),
    distilled from the frozen ``pretrained`` dense model."""
    student_params = [p for i, layer in enumerate(student.layers) if i not in dropped for p in layer.parameters()]
    student_params += list(student.tok_embeddings.parameters()) + list(student.norm.parameters())
    params = student_params + list(replacements.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    warmup = 2
    for step, batch in enumerate(windows.split(4)[:steps]):
        scale = (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        with torch.no_grad():
            teacher = pretrained(batch)
        logits = forward(student, replacements, dropped, batch)
        labels = batch[:, 1:]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten())
        loss = loss + distillation_loss(logits[:, :-1], teacher[:, :-1], labels, 1.0, -100)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=["none", "mean", "linear", "none4"])
    parser.add_argument("--ridge", type=float, default=1e-2)
    parser.add_argument("--fit-windows", type=int, default=48)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    cfg = OmegaConf.load(CONFIG)
    ranked = list(cfg.model.dropped_layers)  # the planner's order: least influential first
    lr = float(cfg.learning_rates.backbone)
    OmegaConf.update(cfg, "model", dense_model_config(OmegaConf.to_container(cfg.model, resolve=True)), merge=False)
    pretrained = load_trained(cfg, Path(cfg.checkpointer.checkpoint_dir))
    tokenizer = config.instantiate(cfg.tokenizer)
    train_file = Path(cfg.dataset.data_files)
    fit_windows = heldout_windows(tokenizer, train_file, SEQ_LEN, args.fit_windows, spread=True)
    validation = heldout_windows(tokenizer, Path("quickstart_work/corpus/validation.jsonl"), SEQ_LEN, 16)
    pool = heldout_windows(tokenizer, train_file, SEQ_LEN, 512, spread=True)

    shape = closed_form.model_shape_from_config(OmegaConf.to_container(cfg.model, resolve=True))
    dense_flops = closed_form.forward_flops(shape, closed_form.RoutingShape.dense(), SEQ_LEN)["total"]
    per_replacement = {"none": 0, "mean": shape.embed_dim, "linear": 2 * shape.embed_dim * (shape.embed_dim + 1)}

    results = {"config": str(CONFIG), "dropped_layers": ranked, "steps": args.steps, "ridge": args.ridge,
               "fit_windows": args.fit_windows, "seq_len": SEQ_LEN, "validation_windows": 16,
               "dense_untrained": validation_loss(pretrained, torch.nn.ModuleDict(), [], validation), "runs": []}
    if args.out.exists():  # resume: keep the runs of the same probe, run the rest
        earlier = json.loads(args.out.read_text())
        if {k: v for k, v in earlier.items() if k != "runs"} != {k: v for k, v in results.items() if k != "runs"}:
            raise SystemExit(f"{args.out} holds a probe with other settings: choose another --out")
        results["runs"] = earlier["runs"]
    done = {(row["arm"], row["seed"]) for row in results["runs"]}
    for arm in args.arms:
        # "none4": plain dropping of only the 4 least influential (more FLOPs than any 5-layer arm)
        kind, count = (arm[:-1], int(arm[-1])) if arm[-1].isdigit() else (arm, len(ranked))
        dropped = sorted(ranked[:count])
        routing = closed_form.RoutingShape(variant="layerdrop", dropped_layers=tuple(dropped))
        flops = closed_form.forward_flops(shape, routing, SEQ_LEN)["total"] + len(dropped) * SEQ_LEN * per_replacement[kind]
        for seed in args.seeds:
            if (arm, seed) in done:
                continue
            start = time.time()
            student = copy.deepcopy(pretrained)
            replacements = (torch.nn.ModuleDict() if kind == "none" else
                            fit(pretrained, fit_windows, dropped, with_matrix=kind == "linear", ridge=args.ridge))
            at_start = validation_loss(student, replacements, dropped, validation)
            order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))
            train(student, pretrained, replacements, dropped, pool[order], args.steps, lr)
            row = {"arm": arm, "dropped_layers": dropped, "seed": seed, "flop_ratio": flops / dense_flops, "validation_step0": at_start,
                   f"validation_step{args.steps}": validation_loss(student, replacements, dropped, validation),
                   "seconds": round(time.time() - start, 1)}
            print(json.dumps(row), flush=True)
            results["runs"].append(row)
            atomic_write_text(args.out, json.dumps(results, indent=1) + "\n")
    table = summary(results)
    atomic_write_text(args.out.with_suffix(".md"), table)
    print(table)


def summary(results: dict) -> str:
    """A markdown table: per arm, FLOPs and validation loss before and after training (mean ± std over seeds),
    and the paired difference from plain dropping of the same layers (``none``)."""
    steps = results["steps"]
    by_arm: Dict[str, Dict[int, dict]] = {}
    for row in results["runs"]:
        by_arm.setdefault(row["arm"], {})[row["seed"]] = row

    def stats(values: List[float]) -> str:
        return fmt_mean_std(values, 3)

    lines = [f"Dropped layers {results['dropped_layers']} (planner order), {steps} distilled steps of 4 × "
             f"{results['seq_len']} tokens, validation {results['validation_windows']} × {results['seq_len']}; "
             f"dense before training {results['dense_untrained']:.3f}. Mean ± std over seeds; Δ paired by seed "
             f"against `none`.", "",
             f"| arm | dropped | FLOPs | seeds | step 0 | step {steps} | Δ step 0 | Δ step {steps} |",
             "|---|---|---|---|---|---|---|---|"]
    reference = by_arm.get("none", {})
    for arm, rows in by_arm.items():
        seeds = sorted(rows)
        first = rows[seeds[0]]
        deltas = {key: [rows[s][key] - reference[s][key] for s in seeds if s in reference]
                  for key in ("validation_step0", f"validation_step{steps}")}
        lines.append(" | ".join([
            f"| {arm}", str(first["dropped_layers"]), f"{first['flop_ratio']:.3f}", str(len(seeds)),
            stats([rows[s]["validation_step0"] for s in seeds]), stats([rows[s][f"validation_step{steps}"] for s in seeds]),
            stats(deltas["validation_step0"]) if arm != "none" and deltas["validation_step0"] else "",
            (stats(deltas[f"validation_step{steps}"]) if arm != "none" and deltas[f"validation_step{steps}"] else "") + " |"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
