"""configs/{eval,generate,quickstart}/*.yaml against configs/: shipped configs agree with each other: an eval or
generate config builds the model its training config trained (same architecture and routing values; LoRA twins are
evaluated merged, as the plain builder). The student's decision rule is the one deployment choice: an inference
config may decide with another rule over the same trained causal router (window top-k where training validated
and calibrated a threshold student)."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchtune_dtf.models.routing_config import STUDENT_RULE_KEYS

REPO = Path(__file__).resolve().parents[1]
LORA_KEYS = ("lora_attn_modules", "apply_lora_to_mlp", "lora_rank", "lora_alpha", "lora_dropout")
INFERENCE_CONFIGS = sorted((REPO / "configs" / "eval").glob("*.yaml")) + sorted((REPO / "configs" / "generate").glob("*.yaml"))
PAIRS = [(path, REPO / "configs" / path.name) for path in INFERENCE_CONFIGS]
PAIRS += [(REPO / "configs" / "quickstart" / f"{kind}_stt_smollm2.yaml", REPO / "configs" / "quickstart" / "stt_smollm2.yaml")
          for kind in ("eval", "generate")]
PAIRS += [(REPO / "configs" / "quickstart" / "eval_dense_smollm2.yaml", REPO / "configs" / "quickstart" / "dense_smollm2.yaml")]
#: The study's recommended recipes for the quickstart model: level → the study run each config is, and the study whose
#: budget it was measured at (0_81_linear: the quickstart's recipe, the ≈ 0.81 one with skip linear maps, 20 steps).
RECOMMENDED = {"0_90": ("experiments/budget_cpu200/study.yaml", "stt_d4_bi2_g625_all_nocurr_fixedcrit_bias_rlr10",
                        "experiments/budget_cpu200/study.yaml"),
               "0_81": ("experiments/budget_cpu200/study.yaml", "stt_d5_bi6_all_nocurr_fixedcrit_bias_rlr10",
                        "experiments/budget_cpu200/study.yaml"),
               "0_72": ("experiments/frontier/study.yaml", "stt_d6_bi10_all_rlr10", "experiments/budget_cpu200/study.yaml"),
               "0_81_linear": ("experiments/skip_maps/study.yaml", "recipe_linear", "experiments/skip_maps/study.yaml")}
PAIRS += [(REPO / "configs" / "quickstart" / f"{kind}_recommended_{level}_smollm2.yaml",
           REPO / "configs" / "quickstart" / f"recommended_{level}_smollm2.yaml")
          for level in RECOMMENDED for kind in ("eval", "generate")]


def merged_model_section(train_cfg_path: Path) -> dict:
    """The training config's model section as its merged (non-LoRA) model."""
    model = OmegaConf.to_container(OmegaConf.load(train_cfg_path).model, resolve=False)
    if any(key in model for key in LORA_KEYS):
        for key in LORA_KEYS:
            model.pop(key, None)
        module, builder = model["_component_"].rsplit(".", 1)
        model["_component_"] = f"{module}.{builder.removeprefix('lora_')}"
    return model


def test_every_inference_config_has_a_training_config():
    assert len(PAIRS) >= 25
    missing = [str(inference.relative_to(REPO)) for inference, train in PAIRS if not train.is_file()]
    assert not missing, f"eval/generate configs without a training config of the same name: {missing}"


@pytest.mark.parametrize("inference, train", PAIRS, ids=[f"{p.parent.name}/{p.name}" for p, _ in PAIRS])
def test_inference_config_builds_the_trained_model(inference, train):
    evaluated = OmegaConf.to_container(OmegaConf.load(inference).model, resolve=False)
    trained = merged_model_section(train)
    differing = {k: (trained.get(k), evaluated.get(k)) for k in set(trained) | set(evaluated)
                 if trained.get(k) != evaluated.get(k) and k not in STUDENT_RULE_KEYS}
    assert not differing, f"{inference.name}: model keys differ from {train.name} (train, eval): {differing}"
    assert all(k in evaluated for k in STUDENT_RULE_KEYS) == all(k in trained for k in STUDENT_RULE_KEYS)


def test_inference_configs_deploy_a_student_that_holds_its_budget_while_generating():
    # A calibrated threshold holds γ only on text like its calibration text (benchmarks/generation_budget.py);
    # the dynamic-capacity STT's student follows its teacher's learned fraction, which only a threshold can.
    rules = {}
    for inference, _ in PAIRS:
        model = OmegaConf.load(inference).model
        if "student_routing_mode" in model:
            rules[inference.name] = model.student_routing_mode
    assert rules and {name for name, rule in rules.items() if rule != "window_topk"} == {"stt_dynamic_qwen0_5b.yaml"}


@pytest.mark.parametrize("level", sorted(RECOMMENDED))
def test_a_recommended_recipe_is_the_study_run_it_reports(level):
    """configs/quickstart/recommended_*: the run's config file with its overrides and the study's budget applied,
    key for key (only where it writes its outputs and how often it validates differ), so the header's numbers
    describe what the config trains."""
    from benchmarks.compiled import study_run

    study_file, name, budget_study = RECOMMENDED[level]
    run = study_run(study_file, name)
    expected = OmegaConf.load(REPO / run["config"])
    budget = OmegaConf.load(REPO / budget_study).budget
    for key, value in {**run["overrides"], **budget}.items():
        OmegaConf.update(expected, key, value)
    shipped = OmegaConf.load(REPO / "configs" / "quickstart" / f"recommended_{level}_smollm2.yaml")
    for key in ("output_dir", "save_every_n_steps", "validation.every_n_steps"):
        OmegaConf.update(expected, key, OmegaConf.select(shipped, key))
    assert OmegaConf.to_container(shipped, resolve=False) == OmegaConf.to_container(expected, resolve=False)


def test_in_training_validation_never_reads_the_test_works():
    """The quickstart scores a finished run once on ``corpus/test.jsonl``; every choice, in-training validation
    included, reads ``corpus/validation.jsonl``. ``heldout.jsonl`` (validation then test) would hand the test works
    to a user who raises ``validation.max_batches``."""
    corpus_files = {}
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        data_files = OmegaConf.select(OmegaConf.load(path), "dataset_val.data_files")
        if isinstance(data_files, str) and "quickstart_work/corpus/" in data_files:
            corpus_files[path.relative_to(REPO).as_posix()] = Path(data_files).name
    assert len(corpus_files) >= 11, corpus_files  # every quickstart training config validates
    assert set(corpus_files.values()) == {"validation.jsonl"}, corpus_files
