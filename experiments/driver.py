"""One (run, seed) end to end, its result JSON, and the ``run`` command over a study.

What ``run`` does for each (run, seed) whose result JSON does not exist yet (finished runs are skipped, so a study is
resumable; delete a JSON to redo that run; a result the study now defines differently is reported as stale):

1. **Train** with the shipped recipe in a subprocess, resuming an interrupted training
   (:mod:`experiments.training`, which documents the command).
2. **Held-out evaluation** in this process, with ``torchtune_dtf.evaluation.routing_report`` (``heldout_windows``,
   ``load_trained``, ``heldout_loss``, ``layer_report``) on the config the recipe saved
   (``<output_dir>/torchtune_config.yaml``) and its final checkpoint ``epoch_0``: the student loss (the deployed
   causal routing; the dense model's default forward), the teacher loss at the β schedule's end values (routed
   variants only), and per routed layer the student's executed fraction and teacher–student agreement.
   With a ``test`` section, the student loss of every test window too (``spread``: windows evenly spaced over the
   whole file, so every work is read); the study's choices read the held-out (validation) file, the test file is
   read once, here, and ``aggregate`` pairs runs on it window by window.
3. **MC accuracy** with torchtune's stock ``tune run eleuther_eval`` (:mod:`experiments.eleuther`), on a config
   written to ``<output_dir>/eleuther/eval_config.yaml``: the template's eval keys, the run's model and tokenizer
   (paths made absolute), and a ``RoutedHFCheckpointer`` on ``epoch_0``. It runs with ``HF_HOME=<work_dir>/hf_home``
   seeded with the offline ``gpt2`` stand-in (``torchtune_dtf.offline.lm_eval_standin``) and the hub switched off.
4. **Compute**, closed form (``torchtune_dtf/closed_form.py``: ``per_token_compute``) at the held-out ``seq_len``
   with the measured executed fractions: forward FLOPs per token of the deployed (student) model and of the
   dense model of the same shape, their ratio, KV bytes per token and ratio, and a distillation teacher's
   FLOPs per training token apart.

Result JSON (``<out_dir>/runs/<run>__seed<k>.json``, written via a temporary file and a rename)
-------------------------------------------------------------------------------------------------
``schema`` ("study_run/1"), ``study``, ``name``, ``seed``, ``variant``, ``config_file``, ``overrides``,
``budget``, ``command`` (the training command), ``output_dir``, ``config`` (the resolved config the recipe
saved), ``steps`` (last logged step), ``planned_steps`` (epochs × max_steps_per_epoch; the data may give
fewer), ``train_tokens`` (sum of the recipe's ``tokens`` metric), ``train_attempts`` ([{mode: fresh|resume,
started, seconds, returncode, log, interrupted?}]), ``wall_time_s`` {train,
heldout_eval, eleuther, eval}, ``curves`` {steps: [...], series: {key: [value or null per step]}} (every key the
DiskLogger logged: ``loss/*``, ``val/lm_loss_student``, ``val/lm_loss_teacher``, ``routing/layer_i/*``, ``lr/*``,
…), ``heldout`` {file, windows, seq_len, tokens, student_loss, teacher_loss (null for dense), teacher_beta
{ce, cu}}, ``test`` (only with a test section: {file, windows, seq_len, placement, tokens, student_loss,
window_losses}), ``layers`` {layer: {student/selected_fraction, teacher/teacher_fraction, teacher/agreement_*, …}},
``executed_fraction`` {layer: student fraction}, ``executed_fraction_mean``, ``eleuther`` (null when skipped;
else {tasks, limit, results: {task: {metric: value, metric_stderr: value}}, mc_acc: mean ``acc`` over tasks}),
``compute`` (``per_token_compute``: seq_len, forward_flops_per_token, dense_forward_flops_per_token,
forward_flops_ratio, forward_flops_by_category_per_token, kv_bytes_per_token, dense_kv_bytes_per_token,
kv_bytes_ratio, bytes_per_value, executed_fraction_used, routed_layers, dropped_layers,
distillation_teacher_flops_per_token, …), ``routing_stats`` {layer_i: {metric: {mean, first, last}}} over the
training log, ``checkpoint_kept``, ``finished_at``.
"""

import argparse
import json
import shutil
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict

from experiments import StudyError
from experiments.eleuther import run_eleuther
from experiments.evaluation import compute_summary, curves_from_log, heldout_evaluation, routing_stats
from experiments.spec import load_study, run_id
from experiments.subprocesses import write_json
from experiments.training import planned_steps, stale_keys, train, train_command

SCHEMA = "study_run/1"


def dumps_result(result: Dict[str, Any]) -> str:
    """JSON with one line per curve series (readable, and diffs stay small)."""
    lines = []
    for key, value in result.items():
        if key == "curves":
            series = ",\n".join(f"   {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                for k, v in value["series"].items())
            body = (f'{{\n  "steps": {json.dumps(value["steps"], separators=(",", ":"))},\n'
                    f'  "series": {{\n{series}\n  }}\n }}')
            lines.append(f" {json.dumps(key)}: {body}")
        elif key == "test":  # the per-window losses on one line
            fields = [f'  {json.dumps(k)}: {json.dumps(v, separators=(",", ":"))}' for k, v in value.items()]
            lines.append(f" {json.dumps(key)}: {{\n" + ",\n".join(fields) + "\n }")
        else:
            lines.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n", "\n "))
    return "{\n" + ",\n".join(lines) + "\n}\n"


def run_one(study: Dict[str, Any], run: Dict[str, Any], seed: int) -> Path:
    """Train, score and write the result JSON of one (run, seed); return the JSON's path."""
    from omegaconf import OmegaConf

    from torchtune_dtf.evaluation.metric_logs import parse_disk_logs

    rid = run_id(run["name"], seed)
    result_path = Path(study["out_dir"]) / "runs" / f"{rid}.json"
    marker = train(study, run, seed)
    output_dir = Path(study["work_dir"]) / "runs" / rid
    saved_config = output_dir / "torchtune_config.yaml"
    checkpoint_dir = output_dir / "epoch_0"
    saved = OmegaConf.to_container(OmegaConf.load(saved_config), resolve=True)

    print(f"== {rid}: held-out evaluation" + (" and test windows" if study.get("test") else ""), flush=True)
    start = time.perf_counter()
    evaluation = heldout_evaluation(saved_config, checkpoint_dir, study["heldout"], study.get("test"))
    test, test_seconds = evaluation.get("test"), evaluation.get("test_seconds")
    heldout_seconds = time.perf_counter() - start - (test_seconds or 0.0)
    eleuther, eleuther_seconds = None, 0.0
    if study.get("eleuther"):
        eleuther, eleuther_seconds = run_eleuther(study, rid, saved_config, checkpoint_dir)

    rows = parse_disk_logs(output_dir / "logs")
    train_steps = [s for s, row in rows.items() if "loss/lm" in row]
    tokens = [row["tokens"] for row in rows.values() if "tokens" in row]
    executed = {int(layer): values["student/selected_fraction"] for layer, values in evaluation["layers"].items()
                if "student/selected_fraction" in values}
    compute = compute_summary(saved, executed, int(study["heldout"]["seq_len"]))
    result = {
        "schema": SCHEMA,
        "study": study["name"],
        "name": run["name"],
        "seed": seed,
        "variant": compute["variant"],
        "config_file": run["config"],
        "overrides": run["overrides"],
        "budget": study["budget"],
        "command": marker.get("command"),
        "output_dir": str(output_dir),
        "steps": max(train_steps) if train_steps else 0,
        "planned_steps": planned_steps(run["config"], study["budget"], run["overrides"]),
        "train_tokens": int(sum(tokens)) if tokens else None,
        "train_attempts": marker.get("attempts", []),
        "wall_time_s": {"train": marker["train_seconds"], "heldout_eval": heldout_seconds,
                        "eleuther": eleuther_seconds if eleuther else None,
                        "eval": heldout_seconds + eleuther_seconds,
                        **({"test_eval": test_seconds} if test is not None else {})},
        "heldout": evaluation["heldout"],
        **({"test": test} if test is not None else {}),
        "layers": evaluation["layers"],
        "executed_fraction": {str(k): v for k, v in sorted(executed.items())},
        "executed_fraction_mean": statistics.fmean(executed.values()) if executed else None,
        "eleuther": eleuther,
        "compute": compute,
        "routing_stats": routing_stats(rows),
        "checkpoint_kept": bool(study.get("keep_checkpoints", True)),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": saved,
        "curves": curves_from_log(rows),
    }
    write_json(result_path, None, dumps_result(result))
    print(f"== {rid}: wrote {result_path}", flush=True)
    if not result["checkpoint_kept"]:
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # the marker keeps the run from training again
    return result_path


def cmd_run(args: argparse.Namespace) -> int:
    """``run``: every (run, seed) of the study (or of ``--only`` / ``--seeds``) that has no current result."""
    from experiments.pages import aggregate

    study = load_study(Path(args.study))
    seeds = [int(s) for s in (args.seeds if args.seeds else study["seeds"])]
    names = [run["name"] for run in study["runs"]]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        raise StudyError(f"--only {unknown}: not runs of {args.study} ({names})")
    runs = [run for run in study["runs"] if not args.only or run["name"] in args.only]
    out_dir = Path(study["out_dir"])
    if not args.dry_run:
        spec = {k: v for k, v in study.items() if not k.startswith("_")}
        spec["source"] = study["_source"]
        write_json(out_dir / "study.json", spec)  # what aggregate expects (runs, seeds, baselines)
    failures = []
    for run in runs:
        for seed in seeds:
            rid = run_id(run["name"], seed)
            result_path = out_dir / "runs" / f"{rid}.json"
            if result_path.is_file():
                stale = stale_keys(study, run, json.loads(result_path.read_text()))
                if not stale:
                    print(f"== {rid}: done, skipped", flush=True)
                    continue
                if not args.rerun_stale:
                    print(f"== {rid}: STALE: the study now defines {', '.join(stale)} differently from what this "
                          f"result trained; --rerun-stale retrains it (or delete {result_path})", flush=True)
                    failures.append(rid)
                    continue
                print(f"== {rid}: stale ({', '.join(stale)}): retraining", flush=True)
                if not args.dry_run:
                    result_path.unlink()
                    shutil.rmtree(Path(study["work_dir"]) / "runs" / rid, ignore_errors=True)
            if args.dry_run:
                output_dir = Path(study["work_dir"]) / "runs" / rid
                print(f"== {rid}: would train: " + " ".join(train_command(study, run, seed, output_dir)), flush=True)
                continue
            try:
                run_one(study, run, seed)
            except StudyError as err:
                print(f"== {rid}: FAILED: {err}", flush=True)
                failures.append(rid)
    if not args.no_aggregate and not args.dry_run:
        aggregate(out_dir)
    if failures:
        print(f"== failed: {', '.join(failures)}", flush=True)
        return 1
    return 0
