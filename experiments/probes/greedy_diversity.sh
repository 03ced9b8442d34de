#!/usr/bin/env bash
# The greedy-diversity probe as run on 2026-12-07 (experiments/probes/greedy_diversity.md): the quickstart's two
# checkpoints (bash scripts/quickstart.sh), two more trained exactly as the quickstart trains (20 steps, seed 42), and
# pretrained models with layers dropped. Re-trains the two extra checkpoints when they are missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
Q=configs/quickstart; K=quickstart_work
QUICKSTART_FLAGS="max_steps_per_epoch=20 save_every_n_steps=20 validation.every_n_steps=10 validation.max_batches=2"
train() {  # output name, config, extra overrides
    [ -d "$K/$1/epoch_0" ] || .venv/bin/tune run torchtune_dtf/recipes/routed_finetune.py --config "$Q/$2.yaml" \
        output_dir="$K/$1" $QUICKSTART_FLAGS "${@:3}"
}
train probe_layerdrop_7 layerdrop_smollm2 distillation.weight=1.0
train probe_recommended_0_81_bias recommended_0_81_smollm2 student_calibration.batches=0
W="model.student_routing_mode=window_topk model.student_threshold=null model.student_window=64"  # the eval configs' rule
.venv/bin/python -m experiments.probes.greedy_diversity --out experiments/probes/greedy_diversity \
  --note "Checkpoints: dense_20_steps and recipe_linear_20_steps are the quickstart's (scripts/quickstart.sh, 2026-12-07); recipe_bias_20_steps and layerdrop_7_20_steps were trained by experiments/probes/greedy_diversity.sh with the quickstart's flags (20 steps × 4 × 256 tokens, seed 42; layer dropping distilled at weight 1.0 as the recipes are). One seed per arm: a probe, not a claim." \
  --arm dense_20_steps $Q/dense_smollm2.yaml $K/dense/epoch_0 \
  --arm recipe_linear_20_steps $Q/recommended_0_81_linear_smollm2.yaml $K/recommended_0_81_linear/epoch_0 $W \
  --arm recipe_bias_20_steps $Q/recommended_0_81_smollm2.yaml $K/probe_recommended_0_81_bias/epoch_0 $W \
  --arm layerdrop_7_20_steps $Q/layerdrop_smollm2.yaml $K/probe_layerdrop_7/epoch_0 \
  --arm recipe_linear_20_steps_every_token_routed $Q/recommended_0_81_linear_smollm2.yaml \
        $K/recommended_0_81_linear/epoch_0 $W model.capacity=1.0 \
  --arm dense_pretrained $Q/dense_smollm2.yaml $K/smollm2_hf \
  --arm drop_5_pretrained $Q/layerdrop_smollm2.yaml $K/smollm2_hf "model.dropped_layers=[14,13,17,15,12]" \
  --arm drop_7_pretrained $Q/layerdrop_smollm2.yaml $K/smollm2_hf
