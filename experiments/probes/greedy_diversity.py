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
from torchtune import config

from torchtune_dtf.atomic_write import atomic_write_text
from torchtune_dtf.evaluation import side_by_side
from torchtune_dtf.evaluation.routing_report import load_config, load_trained

MIN_WORDS = 6


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
                new_tokens: int) -> Dict:
    """Greedy continuations of ``prompts`` by one arm, with the mean distinct-2 and newline share over prompts."""
    cfg = load_config(Path(config_path), list(overrides))
    tokenizer = config.instantiate(cfg.tokenizer)
    model = load_trained(cfg, Path(checkpoint_dir))
    start = time.perf_counter()
    rows = side_by_side.continuations(model, tokenizer, prompts, new_tokens)
    return {
        "config": config_path, "checkpoint": checkpoint_dir, "overrides": list(overrides),
        "distinct_2": statistics.mean(row["distinct_2"] for row in rows),
        "newline_share": statistics.mean(row["newline_share"] for row in rows),
        "seconds": time.perf_counter() - start, "continuations": rows,
    }


def markdown(results: Dict) -> str:
    reference = results["arms"].get(results["reference"])
    lines = [
        f"Greedy continuations of {len(results['prompts'])} prompts from `{results['prompts_file']}` (one per document, "
        f"spread; rule in `experiments/probes/greedy_diversity.py`), {results['new_tokens']} new tokens each, fp32. "
        f"Mean over prompts; ratio = distinct-2 / `{results['reference']}`'s (the quickstart's bar: ≥ 0.8).",
        "",
        "| arm | distinct-2 | ratio | newline share | first continuation |",
        "|---|---|---|---|---|",
    ]
    for name, arm in results["arms"].items():
        ratio = f"{arm['distinct_2'] / reference['distinct_2']:.2f}" if reference else ""
        first = arm["continuations"][0]["text"][:70].replace("\n", "⏎").replace("|", "\\|")
        lines.append(f"| {name} | {arm['distinct_2']:.3f} | {ratio} | {arm['newline_share']:.3f} | {first} |")
    lines += ["", "Arms:", ""]
    for name, arm in results["arms"].items():
        overrides = " ".join(arm["overrides"])
        lines.append(f"- `{name}`: `{arm['config']}` with `{arm['checkpoint']}`" + (f", `{overrides}`" if overrides else ""))
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", nargs="+", action="append", required=True,
                        metavar="NAME CONFIG CHECKPOINT_DIR [key=value]")
    parser.add_argument("--prompts-file", type=Path, default=Path("quickstart_work/corpus/validation.jsonl"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--reference", default=None, help="the arm ratios are taken against (default: the first)")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    parser.add_argument("--note", default="", help="a paragraph for OUT.md (e.g. how the checkpoints were trained)")
    args = parser.parse_args(argv)
    for arm in args.arm:
        if len(arm) < 3 or any("=" not in item for item in arm[3:]):
            parser.error(f"--arm takes NAME CONFIG CHECKPOINT_DIR [key=value ...], got {arm}")
    prompts = rule_prompts(args.prompts_file, args.prompts)
    results = {"prompts_file": str(args.prompts_file), "prompts": prompts, "new_tokens": args.new_tokens,
               "threads": torch.get_num_threads(), "reference": args.reference or args.arm[0][0], "note": args.note,
               "arms": {}}
    for name, config_path, checkpoint_dir, *overrides in args.arm:
        results["arms"][name] = measure_arm(config_path, checkpoint_dir, overrides, prompts, args.new_tokens)
        print(f"{name}: distinct-2 {results['arms'][name]['distinct_2']:.3f}, "
              f"newline share {results['arms'][name]['newline_share']:.3f}", flush=True)
        atomic_write_text(args.out.with_suffix(".json"), json.dumps(results, indent=1) + "\n")
    atomic_write_text(args.out.with_suffix(".md"), markdown(results))
    return results


if __name__ == "__main__":
    main()
