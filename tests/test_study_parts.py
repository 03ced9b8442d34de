"""experiments/parts.py: studies composed from named parts (configs, techniques, placements planned on a measured
layer ranking, generated names) resolve to the plain runs the driver trains; the shipped studies, rewritten from
parts, resolve to exactly the runs they had when each was written out key by key."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import StudyError
from experiments.spec import load_study
from torchtune_dtf.plan import inner_layers_by_influence, plan_layers

REPO = Path(__file__).resolve().parents[1]
BEFORE = json.loads((REPO / "tests" / "assets" / "study_runs_before_parts.json").read_text())
STUDIES = sorted(key for key in BEFORE if not key.startswith("_"))
#: Study sections added with the parts or since (verdict tables): in the resolved study (and study.json) beside what it always held.
ADDED = {"experiments/frontier/study.yaml": ["claims"], "experiments/attribution/study.yaml": ["comparisons"]}
#: Runs a study gained since (names added to its ``runs_from``): each must be exactly its source study's run.
RUNS_ADDED = {"experiments/attribution/study.yaml": ("experiments/budget_cpu200/study.yaml", [
    "stt_d4_bi2_g625_all_nocurr_fixedcrit_bias_rlr10", "layerdrop_4_distill_bias"])}
QUICKSTART = REPO / "configs" / "quickstart"
#: A made-up measurement for the 30 layers of the quickstart model: the inner layers rank 14, 13, 12, … 1, then 15 … 28.
INFLUENCE = [1.0] + [0.5 - 0.01 * layer if layer < 15 else 0.5 + 0.01 * layer for layer in range(1, 29)] + [1.0]


def as_recorded(study: dict) -> dict:
    """What ``run`` writes to study.json for ``study``, with this checkout's paths relative to its root (the root
    itself as ``.``), so that the recorded resolution holds in any clone."""
    spec = {key: value for key, value in study.items() if not key.startswith("_")}
    spec["source"] = study["_source"]
    return json.loads(json.dumps(spec).replace(str(REPO) + "/", "").replace(json.dumps(str(REPO)), json.dumps(".")))


@pytest.mark.parametrize("path", STUDIES)
def test_rewritten_studies_resolve_to_the_runs_they_had_before(path):
    recorded = as_recorded(load_study(REPO / path, root=REPO))
    added = ADDED.get(path, [])
    if path in RUNS_ADDED:
        source, names = RUNS_ADDED[path]
        from_source = {run["name"]: run for run in as_recorded(load_study(REPO / source, root=REPO))["runs"]}
        assert [run for run in recorded["runs"] if run["name"] in names] == [from_source[name] for name in names]
        recorded["runs"] = [run for run in recorded["runs"] if run["name"] not in names]
    assert [key for key in recorded if key not in added] == list(BEFORE[path])  # same sections, same order
    # every run: the same name, config and overrides, keys in the same order (the training command's order)
    assert [json.dumps(run) for run in recorded["runs"]] == [json.dumps(run) for run in BEFORE[path]["runs"]]
    assert json.dumps({k: v for k, v in recorded.items() if k not in added}) == json.dumps(BEFORE[path])


def test_composed_studies_copy_no_layer_list_and_name_no_run_their_parts_can_name():
    # The two rewritten studies plan every layer list on the measured ranking, and let the parts name every run.
    for path in ("experiments/attribution/study.yaml", "experiments/budget_cpu200/study.yaml"):
        text = (REPO / path).read_text()
        runs = text.split("\nruns:\n")[1]
        assert "dropped_layers" not in runs and "routed_layers" not in runs and "name:" not in runs, path
    frontier = (REPO / "experiments/frontier/study.yaml").read_text().split("\nruns:\n")[1]
    assert frontier.count("dropped_layers") == 1  # lora_layerdrop_4_distill_bias: LoRA keys come before the layers


def test_show_prints_the_resolved_runs_with_their_planned_flops():
    proc = subprocess.run([sys.executable, "experiments/study.py", "show", "experiments/budget_cpu200/study.yaml"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = {row["name"]: row for row in map(json.loads, proc.stdout.splitlines())}
    before = {run["name"]: run for run in BEFORE["experiments/budget_cpu200/study.yaml"]["runs"]}
    assert list(shown) == list(before)
    assert all(shown[name]["overrides"] == before[name]["overrides"] for name in before)
    # the ≈ 0.81 hybrid: 0.794 of dense by the closed form (the study's header says so)
    assert shown["stt_d5_bi6_all_nocurr_fixedcrit_bias_rlr10"]["planned_flops_ratio"] == pytest.approx(0.794, abs=1e-3)


def write(tmp_path: Path, runs, techniques=None, **extra) -> Path:
    """A study of ``runs`` with the quickstart configs by name, ``techniques`` and the made-up ranking."""
    (tmp_path / "influence.json").write_text(json.dumps({"block_influence": INFLUENCE}))
    study = {"name": "s", "out_dir": "out", "work_dir": "work", "seeds": [0],
             "heldout": {"file": "h.jsonl", "windows": 4, "seq_len": 256},
             "configs": {"stt": str(QUICKSTART / "stt_smollm2.yaml"), "layerdrop": str(QUICKSTART / "layerdrop_smollm2.yaml")},
             "techniques": techniques or {}, "rankings": {"bi": "influence.json"}, "runs": runs, **extra}
    path = tmp_path / "study.yaml"
    path.write_text(json.dumps(study))  # JSON is YAML
    return path


def resolve(tmp_path: Path, runs, techniques=None, **extra):
    return {run["name"]: run for run in load_study(write(tmp_path, runs, techniques, **extra), root=tmp_path)["runs"]}


def test_techniques_apply_in_definition_order_whatever_order_a_run_lists_them(tmp_path):
    techniques = {"kv": {"model.skipped_tokens_write_kv": True},
                  "curr": {"capacity_curriculum.ramp_steps": 20, "distillation.weight": 1.0},
                  "both": ["kv", "curr"],
                  "nocurr": {"capacity_curriculum.ramp_steps": 0},  # defined later: it wins over curr
                  "fast": {"learning_rates.routers": 0.01}}
    runs = resolve(tmp_path, [{"config": "stt", "use": ["nocurr", "fast", "both"]},
                              {"config": "stt", "use": ["both", "nocurr", "fast"]},
                              {"config": "stt", "use": ["kv"], "overrides": {"model.skipped_tokens_write_kv": False,
                                                                              "model.gate": "scaled"}},
                              {"name": "plain", "config": "stt"}], techniques)
    expected = {"model.skipped_tokens_write_kv": True, "capacity_curriculum.ramp_steps": 0, "distillation.weight": 1.0,
                "learning_rates.routers": 0.01}
    # the name lists them as the run does; the overrides come in the order the definitions first name their keys
    for name in ("stt_nocurr_fast_both", "stt_both_nocurr_fast"):
        assert list(runs[name]["overrides"].items()) == list(expected.items())
        assert runs[name]["config"] == str(QUICKSTART.resolve() / "stt_smollm2.yaml")
    # a run's own overrides come last and win over its techniques'
    assert runs["stt_kv"]["overrides"] == {"model.skipped_tokens_write_kv": False, "model.gate": "scaled"}
    assert runs["plain"]["overrides"] == {}


def test_a_placement_is_the_planners_plan_on_the_measured_ranking(tmp_path):
    ranking = inner_layers_by_influence(INFLUENCE)
    assert ranking[:4] == [14, 13, 12, 11]
    runs = resolve(tmp_path, [
        {"config": "stt", "placement": {"drop": 2, "route": 3, "by": "bi"}},
        {"config": "stt", "placement": {"drop": 1, "route": 2, "capacity": 0.625, "by": "bi", "order": "layer"}},
        {"config": "stt", "placement": {"route": 4, "by": "bi"}},
        {"config": "stt", "placement": {"drop": 2, "target_flops": 0.85, "by": "bi"}},
        {"name": "graded", "config": "stt", "placement": {"route": 2, "capacity": [0.25, 0.75], "by": "bi"}},
        {"config": "stt", "placement": {"capacity": 0.75}},
        {"config": "layerdrop", "placement": {"drop": 3, "by": "bi", "order": "layer"}, "use": ["distill"]},
    ], {"distill": {"distillation.weight": 1.0}})
    assert runs["stt_d2_bi3"]["overrides"] == {"model.dropped_layers": [14, 13], "model.routed_layers": [12, 11, 10]}
    assert runs["stt_d1_bi2_g625"]["overrides"] == {"model.dropped_layers": [14], "model.routed_layers": [12, 13],
                                                    "model.capacity": 0.625}
    # nothing dropped, and the config drops nothing: no dropped_layers override
    assert runs["stt_bi4"]["overrides"] == {"model.routed_layers": [14, 13, 12, 11]}
    assert runs["graded"]["overrides"] == {"model.routed_layers": [14, 13], "model.capacity": [0.25, 0.75]}
    assert runs["stt_75"]["overrides"] == {"model.capacity": 0.75}  # the config's own routed layers at γ 0.75
    assert runs["layerdrop_3_distill"]["overrides"] == {"model.dropped_layers": [12, 13, 14], "distillation.weight": 1.0}
    # a FLOP target: the planner's count, and the name says what it solved
    from omegaconf import OmegaConf

    model = OmegaConf.to_container(OmegaConf.load(QUICKSTART / "stt_smollm2.yaml").model, resolve=True)
    plan = plan_layers(model, ranking, seq_len=256, drop=2, capacity=model["capacity"], target_flops=0.85)
    (targeted,) = [name for name in runs if name.startswith("stt_d2_bi") and name != "stt_d2_bi3"]
    assert targeted == f"stt_d2_bi{len(plan.routed_layers)}"
    assert runs[targeted]["overrides"]["model.routed_layers"] == plan.routed_layers and plan.flop_ratio <= 0.85


def test_one_capacity_per_routed_layer_is_planned_with_as_the_run_writes_it(tmp_path):
    """The planner gets the list (not its mean) in its ranking order; the run writes it as given, paired with its
    routed_layers as listed (ranking order, or by index with ``order: layer``)."""
    from omegaconf import OmegaConf

    from torchtune_dtf import closed_form
    from experiments.parts import Parts, place

    runs = resolve(tmp_path, [
        {"name": "graded", "config": "stt", "placement": {"drop": 1, "route": 3, "capacity": [0.25, 0.5, 0.75], "by": "bi"}},
        {"name": "by_layer", "config": "stt",
         "placement": {"drop": 1, "route": 3, "capacity": [0.25, 0.5, 0.75], "by": "bi", "order": "layer"}},
    ])
    assert runs["graded"]["overrides"] == {"model.dropped_layers": [14], "model.routed_layers": [13, 12, 11],
                                           "model.capacity": [0.25, 0.5, 0.75]}
    assert runs["by_layer"]["overrides"] == {"model.dropped_layers": [14], "model.routed_layers": [11, 12, 13],
                                             "model.capacity": [0.25, 0.5, 0.75]}
    model = OmegaConf.to_container(OmegaConf.load(QUICKSTART / "stt_smollm2.yaml").model, resolve=True)
    parts = Parts(tmp_path)
    parts.add({"rankings": {"bi": "influence.json"}}, "here")
    for name, ranked in (("graded", [0.25, 0.5, 0.75]), ("by_layer", [0.75, 0.5, 0.25])):
        plan = plan_layers(model, inner_layers_by_influence(INFLUENCE), seq_len=256, drop=1, route=3, capacity=ranked)
        written = {**model, **{key.removeprefix("model."): value for key, value in runs[name]["overrides"].items()}}
        routing = closed_form.routing_shape_from_model_config(written, 30, 576)
        assert routing.gamma_of() == dict(zip(plan.routed_layers, ranked)), name  # each layer its planned γ
        assert closed_form.model_config_flop_ratio(written, 256) == pytest.approx(plan.flop_ratio, rel=1e-12)
    with pytest.raises(StudyError, match=r"--capacity lists 2 values but --route 3 routes 3 layers"):
        place({"route": 3, "capacity": [0.25, 0.75], "by": "bi"}, model, parts, 256, "here")
    with pytest.raises(StudyError, match=r"--capacity lists 2 values, one per routed layer: give --route 2"):
        place({"target_flops": 0.9, "capacity": [0.25, 0.75], "by": "bi"}, model, parts, 256, "here")


@pytest.mark.parametrize("runs, techniques, message", [
    ([{"config": "stt", "use": ["kv"]}], {}, r"unknown technique 'kv'"),
    ([{"config": "stt", "use": ["all"]}], {"all": ["kv"], "kv": {"model.skipped_tokens_write_kv": True}},
     r"technique 'all' names \['kv'\], which are not techniques defined above it"),
    ([{"config": "stt", "placement": {"drop": 1, "route": 2}}], {}, r"needs by: RANKING"),
    ([{"config": "stt", "placement": {"drop": 1, "route": 2, "by": "other"}}], {}, r"placement by 'other'"),
    ([{"config": "stt", "placement": {"drop": 1, "route": 2, "by": "bi"},
       "overrides": {"model.routed_layers": [3, 4]}}], {}, r"overrides \['model.routed_layers'\] set what the placement"),
    ([{"config": "layerdrop", "placement": {"drop": 1, "route": 2, "by": "bi"}}], {}, r"routes no layer"),
    ([{"config": "stt", "placement": {"route": 2, "capacity": [0.25, 0.75], "by": "bi"}}], {},
     r"no name, and none can be generated \(one capacity per routed layer\)"),
    ([{"config": str(QUICKSTART / "stt_smollm2.yaml"), "use": []}], {}, r"config is a path, not a name of configs"),
    ([{"config": "stt", "uses": ["kv"]}], {}, r"a run takes \['name', 'config', 'placement', 'use', 'overrides'\]"),
])
def test_a_run_its_parts_cannot_say_is_refused_with_the_reason(tmp_path, runs, techniques, message):
    with pytest.raises(StudyError, match=message):
        resolve(tmp_path, runs, techniques)


def test_parts_files_are_shared_and_a_part_is_defined_once(tmp_path):
    (tmp_path / "parts.yaml").write_text(json.dumps({"techniques": {"kv": {"model.skipped_tokens_write_kv": True}}}))
    runs = resolve(tmp_path, [{"config": "stt", "use": ["kv"]}], parts="parts.yaml")
    assert runs["stt_kv"]["overrides"] == {"model.skipped_tokens_write_kv": True}
    with pytest.raises(StudyError, match=r"technique 'kv' is defined twice"):
        resolve(tmp_path, [{"config": "stt", "use": ["kv"]}], {"kv": {"model.gate": "scaled"}}, parts="parts.yaml")
    (tmp_path / "parts.yaml").write_text(json.dumps({"runs": []}))
    with pytest.raises(StudyError, match=r"a parts file holds \['configs', 'techniques', 'rankings'\] only"):
        resolve(tmp_path, [], parts="parts.yaml")


def test_a_ranking_file_must_agree_with_its_own_measurement(tmp_path):
    write(tmp_path, [{"config": "stt", "placement": {"drop": 1, "route": 1, "by": "bi"}}])
    measured = {"block_influence": INFLUENCE, "inner_layers_by_influence": list(range(1, 29))}
    (tmp_path / "influence.json").write_text(json.dumps(measured))
    with pytest.raises(StudyError, match="is not the ranking of its block_influence"):
        load_study(tmp_path / "study.yaml", root=tmp_path)
