#!/usr/bin/env bash
# Remedies for the quickstart routed model's repetition (experiments/probes/greedy_remedies.md): the quickstart's ≈ 0.81
# recipe retrained with one change each (20 steps, seed 42, the quickstart's flags), and its deployed rule with another
# window, measured by the greedy-diversity probe next to the quickstart's own checkpoints, each with its deployed loss
# on 64 validation windows: a remedy is chosen on validation works and only then scored on the test works. Re-trains
# the remedy checkpoints when they are missing, and measures only arms the JSON does not hold yet (--reuse). Needs the quickstart's checkpoints (bash scripts/quickstart.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
Q=configs/quickstart; K=quickstart_work
RECIPE=recommended_0_81_linear_smollm2
RUN=(.venv/bin/tune run torchtune_dtf/recipes/routed_finetune.py)
train() {  # output name, config, extra overrides (as scripts/quickstart.sh trains), with the recipe in RUN
    [ -d "$K/$1/epoch_0" ] || "${RUN[@]}" --config "$Q/$2.yaml" \
        output_dir="$K/$1" max_steps_per_epoch=20 save_every_n_steps=20 validation.every_n_steps=10 \
        validation.max_batches=2 student_calibration.batches=0 "${@:3}"
}
train_probe() {  # probe module, its environment (NAME=VALUE ...) then --, then train's arguments
    local saved=("${RUN[@]}") module=$1 settings=()
    shift
    while [ "$1" != "--" ]; do settings+=("$1"); shift; done
    RUN=(env "${settings[@]}" .venv/bin/python -m "experiments.probes.$module")
    train "${@:2}"
    RUN=("${saved[@]}")
}
# The backbone trains on the student's own selections in every step, not the teacher's (what generation executes).
train remedy_student_executed $RECIPE scheduled_sampling.share_start=1.0 scheduled_sampling.share_end=1.0
# The KL to the starting (pretrained) model weighs 4× the corpus's next-token loss instead of 1×.
train remedy_distill_4 $RECIPE distillation.weight=4.0
# The backbone moves less from the pretrained weights: a third of its learning rate, or frozen (routing and maps train).
train remedy_backbone_lr_3e-5 $RECIPE learning_rates.backbone=3.0e-5
train remedy_frozen_backbone $RECIPE freeze_base=True
# Token-level unlikelihood of earlier context tokens (experiments/probes/unlikelihood_finetune.py), α = 1 as in its paper
# (the term is then ≈ 0.26 against a next-token loss ≈ 4.2), 2, 3 and 8.
for alpha in 1 2 3 8; do
    train_probe unlikelihood_finetune UNLIKELIHOOD_WEIGHT="$alpha.0" -- "remedy_unlikelihood_$alpha" $RECIPE
done
# What the same term does to the dense control (the bar's reference), at α = 3.
train_probe unlikelihood_finetune UNLIKELIHOOD_WEIGHT=3.0 -- dense_unlikelihood_3 dense_smollm2
# On-policy distillation (experiments/probes/onpolicy_finetune.py): each step the deployed student (window top-k of 64)
# continues the batch's first 24 tokens greedily for 40 and learns the starting model's distribution on them, λ = 1, 4.
ON_POLICY=(ON_POLICY_PROMPT_TOKENS=24 ON_POLICY_NEW_TOKENS=40 ON_POLICY_STUDENT_WINDOW=64)
for weight in 1 4; do
    train_probe onpolicy_finetune ON_POLICY_WEIGHT="$weight.0" "${ON_POLICY[@]}" -- "remedy_onpolicy_$weight" $RECIPE
done
W="model.student_routing_mode=window_topk model.student_threshold=null"  # the eval configs' rule; window per arm
.venv/bin/python -m experiments.probes.greedy_diversity --out experiments/probes/greedy_remedies --loss-windows 64 --reuse \
  --note "Remedy checkpoints trained by experiments/probes/greedy_remedies.sh with the quickstart's flags (20 steps × 4 × 256 tokens, seed 42); dense_20_steps and recipe_linear_20_steps are the quickstart's own checkpoints, layerdrop_7_20_steps the greedy-diversity probe's. remedy_student_executed ran the config's uncalibrated threshold student in training (student_calibration.batches=0), not the deployed window top-k. remedy_unlikelihood_A and dense_unlikelihood_3 were trained by experiments/probes/unlikelihood_finetune.py (the recipe plus token-level unlikelihood) with UNLIKELIHOOD_WEIGHT=A; remedy_onpolicy_L by experiments/probes/onpolicy_finetune.py (the recipe plus distillation on its deployed student's greedy continuations of the batch's first 24 tokens, 40 tokens, window top-k of 64) with ON_POLICY_WEIGHT=L. Prompts and loss windows from the validation works. One seed per arm: a probe, not a claim." \
  --arm dense_20_steps $Q/dense_smollm2.yaml $K/dense/epoch_0 \
  --arm recipe_linear_20_steps $Q/$RECIPE.yaml $K/recommended_0_81_linear/epoch_0 $W model.student_window=64 \
  --arm layerdrop_7_20_steps $Q/layerdrop_smollm2.yaml $K/probe_layerdrop_7/epoch_0 \
  --arm recipe_linear_window_16 $Q/$RECIPE.yaml $K/recommended_0_81_linear/epoch_0 $W model.student_window=16 \
  --arm remedy_student_executed $Q/$RECIPE.yaml $K/remedy_student_executed/epoch_0 $W model.student_window=64 \
  --arm remedy_distill_4 $Q/$RECIPE.yaml $K/remedy_distill_4/epoch_0 $W model.student_window=64 \
  --arm remedy_backbone_lr_3e-5 $Q/$RECIPE.yaml $K/remedy_backbone_lr_3e-5/epoch_0 $W model.student_window=64 \
  --arm remedy_frozen_backbone $Q/$RECIPE.yaml $K/remedy_frozen_backbone/epoch_0 $W model.student_window=64 \
  --arm remedy_unlikelihood_1 $Q/$RECIPE.yaml $K/remedy_unlikelihood_1/epoch_0 $W model.student_window=64 \
  --arm remedy_unlikelihood_2 $Q/$RECIPE.yaml $K/remedy_unlikelihood_2/epoch_0 $W model.student_window=64 \
  --arm remedy_unlikelihood_3 $Q/$RECIPE.yaml $K/remedy_unlikelihood_3/epoch_0 $W model.student_window=64 \
  --arm remedy_unlikelihood_8 $Q/$RECIPE.yaml $K/remedy_unlikelihood_8/epoch_0 $W model.student_window=64 \
  --arm dense_unlikelihood_3 $Q/dense_smollm2.yaml $K/dense_unlikelihood_3/epoch_0 \
  --arm remedy_onpolicy_1 $Q/$RECIPE.yaml $K/remedy_onpolicy_1/epoch_0 $W model.student_window=64 \
  --arm remedy_onpolicy_4 $Q/$RECIPE.yaml $K/remedy_onpolicy_4/epoch_0 $W model.student_window=64
