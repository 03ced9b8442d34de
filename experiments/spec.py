"""The study file: what a study trains, read, validated and made absolute (``load_study``).

Study file (YAML)
-----------------
::

    name: frontier_135m
    out_dir: experiments/frontier_135m                 # results: <out_dir>/runs/<run>__seed<k>.json, README.md, *.png
    work_dir: quickstart_work/studies/frontier_135m    # checkpoints, logs, eval configs (git-ignored)
    seeds: [0, 1, 2]
    budget: {max_steps_per_epoch: 100, batch_size: 4}  # config overrides applied to every run (same budget)
    validation_points: 4                               # optional (default 4): validation + checkpoint this often
    keep_checkpoints: true                             # optional (default true); false deletes a run's epoch_0
                                                       # once its JSON is written (135M: ~1.6 GB with the optimizer)
    heldout: {file: quickstart_work/corpus/heldout.jsonl, windows: 16, seq_len: 256, batch_size: 4}
    test: {file: quickstart_work/corpus/test.jsonl, windows: 64, seq_len: 256, spread: true}   # optional: scored
                                                       # once per finished run, never by a choice
    eleuther:                                          # or null to skip the stock eleuther_eval step
      config: configs/quickstart/eval_stt_smollm2.yaml # template: every eval key but model/tokenizer/checkpointer
      include_path: quickstart_work/corpus/lm_eval_tasks   # optional; default: the template's, relative to cwd
      cwd: .                                           # optional: where `tune run eleuther_eval` runs (task data paths)
      tasks: [heldout_next_sentence]                   # optional: default the template's
      limit: 100                                       # optional: default the template's
    baselines: [dense]                                 # run names every other run is paired against
    claims_runs: [stt_papers]                          # optional: the runs claims.png draws (default: every SDT/STT
                                                       # run; a study of many recipes names the papers' setting)
    gaps: [dense]                                      # optional: the baselines the page plots each run's validation
                                                       # gap to, step by step (gaps.png; a longer run's question)
    claims: {stt: stt_papers}                          # optional: run names by role for experiments/frontier/claims.py
                                                       # and targets.py (dense, papers, and ablations: {run without
                                                       # any technique: {technique: run with it}})
    comparisons:                                       # optional: verdict tables on the test windows, one a level
      - title: same shape, who routes                  #   arms that compete for one budget (labels: run names);
        ranked: {surprise: stt_papers, MoD: mod_papers}  # the page names the best and its margin over the rest
        beside: {dense: dense}                         # optional: shown against that best, not ranked
        line: [layerdrop_7, layerdrop_8]               # optional: runs at other FLOPs (two or more) every arm is
                                                       #   measured against, interpolated at the arm's own FLOPs
                                                       #   (with a line, one ranked arm is enough)
    runs:
      - name: dense
        config: configs/quickstart/dense_smollm2.yaml
        overrides: {}                                  # dotted key: value, passed to `tune run` as key=value
      - name: stt_papers
        config: configs/quickstart/stt_smollm2.yaml
        overrides: {model.gate: scaled, model.routed_layers: every_other}

A run may instead be composed from named parts (configs, techniques, a placement planned on a measured layer
ranking) and take its name from them: see :mod:`experiments.parts`. Either way a run resolves to ``{name, config,
overrides}``, which is what the driver trains and ``study.json`` records.

A run's overrides may not touch a budget key (every run trains on the same budget). A study that repeats another's
runs at another budget or on another machine names them instead of copying them (``runs_from``; the list ``runs``,
if present, adds runs of its own after them)::

    runs_from: {study: experiments/frontier/study.yaml, names: [dense, layerdrop_4_distill_bias]}
"""

import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from experiments import StudyError


def run_id(name: str, seed: int) -> str:
    """The file and folder name of one (run, seed): ``<run>__seed<k>``."""
    return f"{name}__seed{seed}"


def _claims_problems(claims: Any, names: List[str]) -> List[str]:
    """What is wrong with a ``claims`` section: run names by role, and ``ablations``: {run: {technique: run}}."""
    if not isinstance(claims, dict):
        return [f"claims must map roles to run names, got {claims!r}"]
    ablations = claims.get("ablations", {})
    roles = {role: run for role, run in claims.items() if role != "ablations"}
    if not all(isinstance(run, str) for run in roles.values()):
        return [f"claims must map roles to run names, got {claims!r}"]
    if not isinstance(ablations, dict) or not all(
            isinstance(techniques, dict) and all(isinstance(run, str) for run in techniques.values())
            for techniques in ablations.values()):
        return [f"claims.ablations must map a run to {{technique: the run with it}}, got {ablations!r}"]
    named = set(roles.values()) | set(ablations) | {run for runs in ablations.values() for run in runs.values()}
    unknown = sorted(named - set(names))
    return [f"claims {unknown} are not run names"] if unknown else []


def _comparisons_problems(comparisons: Any, names: List[str]) -> List[str]:
    """What is wrong with a ``comparisons`` section: a list of ``{title, ranked: {label: run}, beside: {label: run},
    line: [run, ...]}`` with at least two ranked arms (one where a line is given: a recipe against the line), every
    arm a run name, no run twice among the arms, and a line (optional) of two or more runs of the study."""
    if not isinstance(comparisons, list):
        return [f"comparisons must be a list of {{title, ranked, beside, line}}, got {comparisons!r}"]
    problems = []
    for i, comparison in enumerate(comparisons):
        where = f"comparisons[{i}]"
        if not isinstance(comparison, dict) or not set(comparison) <= {"title", "ranked", "beside", "line"}:
            problems.append(f"{where} must be {{title, ranked, beside, line}}, got {comparison!r}")
            continue
        ranked, beside, line = comparison.get("ranked"), comparison.get("beside") or {}, comparison.get("line", [])
        if not isinstance(comparison.get("title"), str):
            problems.append(f"{where} needs a title")
        fewest = 1 if comparison.get("line") else 2  # one arm is a verdict only against a line
        if not isinstance(ranked, dict) or len(ranked) < fewest or not isinstance(beside, dict):
            problems.append(f"{where}: ranked must map two or more labels to run names, or one with a line "
                            "(beside: labels to run names)")
            continue
        if "line" in comparison and (not isinstance(line, list) or len(line) < 2):
            problems.append(f"{where}: line must list two or more run names (the line is drawn between them), "
                            f"got {line!r}")
            line = []
        line = [str(run) for run in line] if isinstance(line, list) else []
        arms = list(ranked.values()) + list(beside.values())
        unknown = sorted({str(run) for run in arms + line} - set(names))
        if unknown:
            problems.append(f"{where} {unknown} are not run names")
        if len(set(map(str, arms))) != len(arms):
            problems.append(f"{where} names a run twice: {arms}")
    return problems


def _runs_from(source: Any, root: Path, path: Path) -> List[Dict[str, Any]]:
    """``runs_from: {study: other.yaml, names: [...]}``: those runs of another study, definitions and all, so that
    a study at another budget trains exactly what the first one did (the copies cannot drift apart)."""
    if not isinstance(source, dict) or set(source) != {"study", "names"} or not source["names"]:
        raise StudyError(f"{path}: runs_from needs exactly {{study: PATH, names: [RUN, ...]}}, got {source!r}")
    other = root / source["study"]
    if not other.is_file():
        raise StudyError(f"{path}: runs_from study {str(other)!r} does not exist")
    defined = {run["name"]: run for run in load_study(other, root)["runs"]}  # validated as a study of its own
    unknown = [name for name in source["names"] if name not in defined]
    if unknown:
        raise StudyError(f"{path}: runs_from names {unknown} are not runs of {source['study']}")
    return [defined[name] for name in source["names"]]


def load_study(path: Path, root: Optional[Path] = None) -> Dict[str, Any]:
    """The study as a plain dict, its runs resolved from their parts and paths made absolute against ``root``
    (default: the working directory). The keys keep the file's order (``study.json`` is this dict), the parts
    sections are consumed, and ``_root`` / ``_source`` say where it was read."""
    from omegaconf import OmegaConf

    from experiments.parts import resolve_runs

    root = Path(root or Path.cwd()).resolve()
    study = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    required = ("name", "out_dir", "work_dir", "seeds") + (() if "runs_from" in study else ("runs",))
    problems = [f"missing key {key!r}" for key in required if key not in study]
    if problems:
        raise StudyError(f"{path}: " + "; ".join(problems))
    resolved = resolve_runs(study, Path(path), root)  # takes the parts sections out of ``study``
    if "runs" in study:
        study["runs"] = resolved
    if "runs_from" in study:
        study["runs"] = _runs_from(study.pop("runs_from"), root, path) + list(study.get("runs") or [])
    study.setdefault("budget", {})
    study.setdefault("baselines", [])
    study.setdefault("claims_runs", None)
    study.setdefault("eleuther", None)
    study.setdefault("validation_points", 4)
    study.setdefault("keep_checkpoints", True)
    if "heldout" not in study or not study["heldout"]:
        raise StudyError(f"{path}: missing heldout: {{file, windows, seq_len}}")
    absolute = lambda p: str((root / p).resolve()) if p is not None else None  # noqa: E731
    study["out_dir"], study["work_dir"] = absolute(study["out_dir"]), absolute(study["work_dir"])
    study["heldout"] = {"batch_size": 4, **study["heldout"], "file": absolute(study["heldout"]["file"])}
    if study.get("test"):  # optional (a study without one writes the study.json it always wrote)
        test = dict(study["test"])
        missing = [key for key in ("file", "windows", "seq_len", "spread") if key not in test]
        if missing:
            raise StudyError(f"{path}: test needs {{file, windows, seq_len, spread}}; missing {missing}")
        if Path(absolute(test["file"])) == Path(study["heldout"]["file"]):
            raise StudyError(f"{path}: test file {test['file']!r} is the held-out (validation) file; a test set must "
                             "be text no choice has looked at")
        study["test"] = {"batch_size": 4, **test, "file": absolute(test["file"])}
    if study["eleuther"]:
        el = dict(study["eleuther"])
        el["config"] = absolute(el["config"])
        el["cwd"] = absolute(el.get("cwd") or ".")
        if el.get("include_path") is not None:
            el["include_path"] = absolute(el["include_path"])
        study["eleuther"] = el
    names = [run.get("name") for run in study["runs"]]
    if any(not isinstance(n, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", n) for n in names):
        problems.append(f"every run needs a name of letters, digits, '_', '.', '-': {names}")
    if len(set(names)) != len(names):
        problems.append(f"run names repeat: {names}")
    for run in study["runs"]:
        run.setdefault("overrides", {})
        run["overrides"] = dict(run["overrides"] or {})
        if "config" not in run:
            problems.append(f"run {run.get('name')!r} has no config")
            continue
        run["config"] = absolute(run["config"])
        clash = sorted(set(run["overrides"]) & set(study["budget"]))
        if clash:
            problems.append(f"run {run['name']!r} overrides budget key(s) {clash}: every run has the same budget")
    unknown = sorted(set(study["baselines"]) - set(names))
    if unknown:
        problems.append(f"baselines {unknown} are not run names")
    unknown = sorted(set(study["claims_runs"] or []) - set(names))
    if unknown:
        problems.append(f"claims_runs {unknown} are not run names")
    unknown = sorted(set(study.get("gaps") or []) - set(names))
    if unknown:
        problems.append(f"gaps {unknown} are not run names")
    if "claims" in study:
        problems += _claims_problems(study["claims"], names)
    if "comparisons" in study:
        problems += _comparisons_problems(study["comparisons"], names)
    if problems:
        raise StudyError(f"{path}: " + "; ".join(problems))
    study["_root"] = str(root)
    study["_source"] = str(Path(path).resolve())
    return study
