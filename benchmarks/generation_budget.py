"""Does a trained student execute its budget while it generates? (issue 47, item 4)

    python -m benchmarks.generation_budget --work quickstart_work [--run recommended_0_81] [--windows 16 32 64] \
        [--max-new-tokens 32 256]

For a trained quickstart checkpoint (``--run``: ``recommended_0_81``, the quickstart's routed run that
``bash scripts/quickstart.sh`` writes, or ``stt``, the papers' setting ``configs/quickstart/stt_smollm2.yaml``
trained into ``quickstart_work/stt``) and each student rule
(the calibrated ``threshold`` the training config validates, and ``window_topk`` at each window, the shipped
generate and eval configs' rule at 64), it

* runs ``tune run torchtune_dtf/recipes/routed_generate.py`` (greedy, the quickstart generate config) on each
  prompt and length, and parses the executed fraction it prints (prompt tokens + one per decode step);
* scores the held-out text teacher-forced (``torchtune_dtf.evaluation.routing_report``: student loss, dense
  loss, executed fraction), so a rule that holds the budget in generation is also seen not to cost quality.

Every value comes from the checkpoint and config as shipped, with only the student rule overridden on the
command line. Writes ``results.json`` and ``results.md`` to ``--out``.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import mean
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "quickstart"


def train_config(run: str) -> Path:
    return CONFIGS / f"{run}_smollm2.yaml"


def generate_config(run: str) -> Path:
    return CONFIGS / f"generate_{run}_smollm2.yaml"
PROMPTS = (
    "Shall I compare thee to a summer's day?",   # the generate config's own prompt
    "The king rode out at dawn, and",
    "Of Man's first disobedience, and the fruit",
)
MARKER = re.compile(r"executed fraction per routed layer: (.*); mean ([0-9.]+)")


def student_overrides(rule: str, run: str) -> List[str]:
    """Command-line overrides that set the student rule (everything else stays as configured): ``threshold``
    is the training config's calibrated threshold student, ``window_topk_W`` the window top-k over W scores."""
    if rule == "threshold":
        from omegaconf import OmegaConf

        trained = OmegaConf.load(train_config(run)).model
        return ["model.student_routing_mode=threshold", f"model.student_threshold={trained.student_threshold}",
                "model.student_window=null"]
    window = int(rule.split("_")[-1])
    return ["model.student_routing_mode=window_topk", "model.student_threshold=null", f"model.student_window={window}"]


def generate(work: Path, run: str, rule: str, prompt: str, max_new_tokens: int) -> Dict:
    tune = Path(sys.executable).with_name("tune")
    cmd = [str(tune), "run", "torchtune_dtf/recipes/routed_generate.py", "--config", str(generate_config(run)),
           f"prompt.user={prompt}", f"max_new_tokens={max_new_tokens}", *student_overrides(rule, run)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    found = MARKER.search(out)
    text = re.search(r"Model is initialized[^\n]*\n(.*?)\n[^\n]*Time for inference", out, re.S)
    per_layer = {int(k): float(v) for k, v in (item.split(": ") for item in found.group(1).split(", "))}
    return {"rule": rule, "prompt": prompt, "max_new_tokens": max_new_tokens, "mean_executed": float(found.group(2)),
            "executed_per_layer": per_layer, "text": text.group(1).strip() if text else None}


def heldout(work: Path, run: str, rule: str, windows: int, seq_len: int) -> Dict:
    from torchtune_dtf.evaluation import routing_report

    cwd = os.getcwd()
    os.chdir(work.parent)  # the training configs name their files as quickstart_work/…, from the folder above
    try:
        report = routing_report.main([
            "--dense", str(REPO / "configs/quickstart/dense_smollm2.yaml"), str(work / "dense" / "epoch_0"),
            "--routed", str(train_config(run)), str(work / run / "epoch_0"),
            "--heldout", str(work / "corpus" / "heldout.jsonl"), "--windows", str(windows), "--seq-len", str(seq_len),
            *student_overrides(rule, run),
        ])
    finally:
        os.chdir(cwd)
    fractions = [row["student/selected_fraction"] for row in report["layers"].values()]
    return {"rule": rule, "dense_loss": report["loss"]["dense"], "student_loss": report["loss"]["routed_student"],
            "mean_executed": mean(fractions), "heldout_tokens": report["heldout_tokens"]}


def render(results: Dict) -> str:
    lines = [f"# Executed fraction in generation vs budget ({results['budget']}), quickstart `{results.get('run', 'stt')}` "
             "checkpoint", "",
             f"`{results['command']}` on {results['date']}; the quickstart's checkpoint "
             f"(`{results['checkpoint']}`), greedy, fp32, CPU.", "",
             "## routed_generate (prompt tokens + one per decode step, mean over routed layers)", "",
             "| student rule | max_new_tokens | " + " | ".join(f"prompt {i + 1}" for i in range(len(results["prompts"])))
             + " | mean | mean − budget | layers, lowest – highest |", "|---|---|" + "---|" * (len(results["prompts"]) + 3)]
    runs = results["generation"]
    for rule in results["rules"]:
        for length in results["max_new_tokens"]:
            chosen = [r for r in runs if r["rule"] == rule and r["max_new_tokens"] == length]
            row = [r["mean_executed"] for r in chosen]
            layers = [f for r in chosen for f in r["executed_per_layer"].values()]
            lines.append(f"| {rule} | {length} | " + " | ".join(f"{v:.3f}" for v in row)
                         + f" | {mean(row):.3f} | {mean(row) - results['budget']:+.3f} | {min(layers):.2f} – {max(layers):.2f} |")
    lines += ["", "Prompts: " + "; ".join(f"{i + 1}. “{p}”" for i, p in enumerate(results["prompts"])), "",
              "## Held-out text, teacher-forced (routing_report)", "",
              "| student rule | student loss | dense loss | executed fraction |", "|---|---|---|---|"]
    for row in results["heldout"]:
        lines.append(f"| {row['rule']} | {row['student_loss']:.4f} | {row['dense_loss']:.4f} | {row['mean_executed']:.3f} |")
    lines += ["", "## Continuations (prompt 1, longest length)", ""]
    for r in runs:
        if r["prompt"] == results["prompts"][0] and r["max_new_tokens"] == max(results["max_new_tokens"]):
            lines.append(f"- {r['rule']}: {json.dumps(r['text'])[:400]}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO / "quickstart_work")
    parser.add_argument("--run", default="stt", choices=["stt", "recommended_0_81", "recommended_0_81_linear"],
                        help="the quickstart run whose checkpoint (WORK/RUN/epoch_0) and configs are measured")
    parser.add_argument("--windows", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--heldout-windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/generation_budget, or the first free _2, _3, …")
    parser.add_argument("--overwrite", action="store_true", help="replace the results an existing --out holds")
    args = parser.parse_args(argv)
    from benchmarks.common import results_dir

    args.out = results_dir(args.out, REPO / "benchmarks" / "results" / "generation_budget", overwrite=args.overwrite)
    work = args.work.resolve()
    if not (work / args.run / "epoch_0").is_dir() or work.name != "quickstart_work":
        raise SystemExit(f"{work}/{args.run}/epoch_0 not found (a folder named quickstart_work, as the quickstart writes "
                         "it): run `bash scripts/quickstart.sh` first (the papers' setting: tune run its config)")
    rules = ["threshold"] + [f"window_topk_{w}" for w in args.windows]
    from omegaconf import OmegaConf

    capacity = OmegaConf.load(generate_config(args.run)).model.capacity
    budget = mean(capacity) if isinstance(capacity, Sequence) else float(capacity)

    results = {
        "command": "python -m benchmarks.generation_budget " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "run": args.run, "checkpoint": str(work / args.run / "epoch_0"),
        "budget": budget, "rules": rules,
        "prompts": list(PROMPTS), "max_new_tokens": args.max_new_tokens, "generation": [], "heldout": [],
    }
    for rule in rules:
        for length in args.max_new_tokens:
            for prompt in PROMPTS:
                results["generation"].append(generate(work, args.run, rule, prompt, length))
                print(json.dumps({k: v for k, v in results["generation"][-1].items() if k != "text"}), flush=True)
        results["heldout"].append(heldout(work, args.run, rule, args.heldout_windows, args.seq_len))
        print(json.dumps(results["heldout"][-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(render(results))
    print(render(results))
    return results


if __name__ == "__main__":
    main()
