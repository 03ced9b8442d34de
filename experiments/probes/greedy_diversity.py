"""Probe: how repetitive are greedy continuations of a routed, a layer-dropped and a dense model?

Issue 48 asks the quickstart's routed student to write about as varied text as the dense control: distinct-2 of
its greedy continuations (distinct token bigrams over all bigrams; a loop drives it to 0) within 20 % of dense's.
The quickstart prints three famous prompts, too few to tell a model from its luck. This probe continues N prompts
drawn by a fixed rule from held-out works (each of N documents spread over the file, the middle line among its
lines of at least six words that are not a speaker's name in capitals), greedily, ``--new-tokens`` each, with each
arm's deployed routing, and reports the mean distinct-2 and newline share per arm.

An arm is ``NAME CONFIG CHECKPOINT_DIR [key=value ...]``: a checkpoint the recipe saved (``epoch_N``) or a stock HF
folder (a base model, loaded with the config's routing initialised as training starts), with overrides as
``tune run`` takes them (e.g. the deployed student rule of an eval config). Arms run one after another on the same
prompts; the prompts come from the validation works by default, never the test works the recipes are scored on.

    bash experiments/probes/greedy_diversity.sh   # the arms measured on 2026-12-07, or by hand:
    OMP_NUM_THREADS=2 .venv/bin/python -m experiments.probes.greedy_diversity --out experiments/probes/greedy_diversity \\
        --arm dense_finetuned configs/quickstart/dense_smollm2.yaml quickstart_work/dense/epoch_0 \\
        --arm ...

(``greedy_diversity.md`` beside the JSON is what the script printed, with every arm it measured).
"""

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch
from omegaconf import OmegaConf
from torchtune import config

from torchtune_dtf.atomic_write import atomic_write_text
from torchtune_dtf.evaluation import side_by_side
from torchtune_dtf.evaluation.routing_report import heldout_windows, load_config, load_trained
from torchtune_dtf.models.model_config import model_variant
from torchtune_dtf.models.routing_config import STATIC_VARIANTS
from torchtune_dtf.modules.routing_context import RoutingContext

MIN_WORDS = 6
LOSS_SEQ_LEN = 256  # the quickstart's held-out window


def rule_prompts(jsonl: Path, count: int) -> List[str]:
    """``count`` prompts, one per document spread evenly over ``jsonl`` (a ``text`` field per line): the middle one of
    the document's lines with at least ``MIN_WORDS`` words that are not all capitals (stage directions and speaker
    names are)."""
    documents = [json.loads(line)["text"] for line in jsonl.read_text().splitlines() if line.strip()]
    if count > len(documents):
        raise ValueError(f"{jsonl} has {len(documents)} documents; asked for {count} prompts (one per document)")
    prompts = []
    for i in range(count):
        document = documents[(i * len(documents)) // count]
        lines = [s.strip() for s in document.split("\n") if len(s.split()) >= MIN_WORDS and not s.strip().isupper()]
        if not lines:
            raise ValueError(f"document {(i * len(documents)) // count} of {jsonl} has no line of {MIN_WORDS} words")
        prompts.append(lines[len(lines) // 2])
    return prompts


def measure_arm(config_path: str, checkpoint_dir: str, overrides: Sequence[str], prompts: Sequence[str],
                new_tokens: int, loss_file: Path = None, loss_windows: int = 0) -> Dict:
    """Greedy continuations of ``prompts`` by one arm, with the mean distinct-2 and newline share over prompts, and
    with ``loss_windows`` > 0 the arm's deployed loss on that many 256-token windows spread over ``loss_file`` (so a
    remedy for repetition is seen next to what it costs in loss, on the same validation works)."""
    cfg = load_config(Path(config_path), list(overrides))
    tokenizer = config.instantiate(cfg.tokenizer)
    model = load_trained(cfg, Path(checkpoint_dir))
    start = time.perf_counter()
    rows = side_by_side.continuations(model, tokenizer, prompts, new_tokens)
    result = {
        "config": config_path, "checkpoint": checkpoint_dir, "overrides": list(overrides),
        "distinct_2": statistics.mean(row["distinct_2"] for row in rows),
        "newline_share": statistics.mean(row["newline_share"] for row in rows),
        "seconds": time.perf_counter() - start, "continuations": rows,
    }
    if loss_windows:
        windows = heldout_windows(tokenizer, loss_file, LOSS_SEQ_LEN, loss_windows, spread=True)
        static = model_variant(OmegaConf.to_container(cfg.model, resolve=True)) in STATIC_VARIANTS
        routing = None if static else (lambda: RoutingContext(mode="student"))  # dense, layer dropping: no context
        result["loss"] = float(side_by_side.window_losses(model, windows, routing, batch_size=4).mean())
    return result


def _standard_error(values: Sequence[float]) -> float:
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")


def markdown(results: Dict) -> str:
    reference = results["arms"].get(results["reference"])
    lines = [
        f"Greedy continuations of {len(results['prompts'])} prompts from `{results['prompts_file']}` (one per document, "
        f"spread; rule in `experiments/probes/greedy_diversity.py`), {results['new_tokens']} new tokens each, fp32. "
        f"Mean over prompts ± its standard error over prompts; ratio = distinct-2 / `{results['reference']}`'s (the "
        f"quickstart's bar: ≥ 0.8); Δ = distinct-2 − the reference's, paired by prompt, ± its standard error.",
        "",
    ]
    losses = results.get("loss_windows", 0)
    if losses:
        lines[0] += (f" Loss: deployed (student) next-token loss on {losses} windows × {LOSS_SEQ_LEN} tokens spread over "
                     f"the same file; Δ loss against the reference arm.")
    lines += ["| arm | distinct-2 | ratio | Δ | newline share |" + (" loss | Δ loss |" if losses else "") + " first continuation |",
              "|---|---|---|---|---|" + ("---|---|" if losses else "") + "---|"]
    for name, arm in results["arms"].items():
        per_prompt = [row["distinct_2"] for row in arm["continuations"]]
        ratio = f"{arm['distinct_2'] / reference['distinct_2']:.2f}" if reference else ""
        delta = ""
        if reference and arm is not reference:
            paired = [a - b for a, b in zip(per_prompt, (row["distinct_2"] for row in reference["continuations"]))]
            delta = f"{statistics.mean(paired):+.3f} ± {_standard_error(paired):.3f}"
        first = arm["continuations"][0]["text"][:70].replace("\n", "⏎").replace("|", "\\|")
        loss = ""
        if losses:
            loss_delta = f"{arm['loss'] - reference['loss']:+.3f}" if reference else ""
            loss = f" {arm['loss']:.3f} | {loss_delta} |"
        lines.append(f"| {name} | {arm['distinct_2']:.3f} ± {_standard_error(per_prompt):.3f} | {ratio} | {delta} | "
                     f"{arm['newline_share']:.3f} |{loss} {first} |")
    lines += ["", "Arms:", ""]
    for name, arm in results["arms"].items():
        overrides = " ".join(arm["overrides"])
        lines.append(f"- `{name}`: `{arm['config']}` with `{arm['checkpoint']}`" + (f", `{overrides}`" if overrides else ""))
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join(lines) + "\n"


def _earlier_arms(path: Path, results: Dict) -> Dict:
    """The arms of an earlier run of this probe at ``path`` when it used the same prompts and measures (else none)."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    same_measure = all(earlier.get(key) == results[key] for key in ("prompts", "new_tokens", "loss_windows"))
    return earlier["arms"] if same_measure else {}


def main(argv: Sequence[str] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", nargs="+", action="append", required=True,
                        metavar="NAME CONFIG CHECKPOINT_DIR [key=value]")
    parser.add_argument("--prompts-file", type=Path, default=Path("quickstart_work/corpus/validation.jsonl"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--loss-windows", type=int, default=0,
                        help="also score each arm's deployed loss on this many windows of the prompts file (0: off)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the arms OUT.json already holds with the same definition, prompts and measures "
                             "(measure only new arms; a checkpoint retrained in place is not noticed)")
    parser.add_argument("--reference", default=None, help="the arm ratios are taken against (default: the first)")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    parser.add_argument("--note", default="", help="a paragraph for OUT.md (e.g. how the checkpoints were trained)")
    args = parser.parse_args(argv)
    for arm in args.arm:
        if len(arm) < 3 or any("=" not in item for item in arm[3:]):
            parser.error(f"--arm takes NAME CONFIG CHECKPOINT_DIR [key=value ...], got {arm}")
    prompts = rule_prompts(args.prompts_file, args.prompts)
    results = {"prompts_file": str(args.prompts_file), "prompts": prompts, "new_tokens": args.new_tokens,
               "threads": torch.get_num_threads(), "loss_windows": args.loss_windows,
               "reference": args.reference or args.arm[0][0], "note": args.note,
               "arms": {}}
    earlier = _earlier_arms(args.out.with_suffix(".json"), results) if args.reuse else {}
    for name, config_path, checkpoint_dir, *overrides in args.arm:
        same = earlier.get(name)
        if same and (same["config"], same["checkpoint"], same["overrides"]) == (config_path, checkpoint_dir, overrides):
            results["arms"][name] = same
            print(f"{name}: reused from {args.out.with_suffix('.json')}", flush=True)
            continue
        results["arms"][name] = measure_arm(config_path, checkpoint_dir, overrides, prompts, args.new_tokens,
                                             args.prompts_file, args.loss_windows)
        arm = results["arms"][name]
        print(f"{name}: distinct-2 {arm['distinct_2']:.3f}, newline share {arm['newline_share']:.3f}"
              + (f", loss {arm['loss']:.4f}" if "loss" in arm else ""), flush=True)
        atomic_write_text(args.out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    atomic_write_text(args.out.with_suffix(".md"), markdown(results))
    return results


if __name__ == "__main__":
    main()
