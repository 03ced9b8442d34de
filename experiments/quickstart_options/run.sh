#!/usr/bin/env bash
# The routing options of docs/design.md R2/R5 measured on the quickstart (issue 12): each run fine-tunes SmolLM2-135M
# as STT (γ = 0.5) for the quickstart's steps with one option changed from the papers' setting, then
# `python -m torchtune_dtf.evaluation.routing_report` scores it against the dense control on the held-out works
# (student = the deployed causal routing) and writes one JSON per run next to this script.
#
#   bash scripts/quickstart.sh                      # once: .venv, SmolLM2 → HF, corpus (and the dense control)
#   bash experiments/quickstart_options/run.sh [NAME ...]
#
# Finished runs (their JSON exists) are skipped; delete a JSON to rerun it. QUICKSTART_STEPS as quickstart.sh;
# SEED (default 42, the quickstart's) sets the data order and the routing initialisation of a run and of its
# dense control; runs of other seeds are named <name>_seed<SEED>.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
STEPS=${QUICKSTART_STEPS:-40}
SEED=${SEED:-42}
SUFFIX=""
if [ "$SEED" != 42 ]; then SUFFIX="_seed$SEED"; fi
WORK=quickstart_work/options
OUT=experiments/quickstart_options
PY=.venv/bin/python
TUNE=.venv/bin/tune
CFG=configs/quickstart/stt_smollm2.yaml
# The papers' setting as the baseline; each other run changes what its name says.
PAPERS="model.gate=scaled model.routed_layers=every_other model.always_run_first_token=False scheduled_sampling.share_end=0.0"
declare -A RUNS=(
    [papers]="$PAPERS"
    [straight_through]="$PAPERS model.gate=straight_through"
    [scheduled_sampling]="$PAPERS scheduled_sampling.share_end=0.5 scheduled_sampling.ramp_steps=$((STEPS / 2))"
    [inner_layers]="$PAPERS model.routed_layers=every_other_inner"
    [first_token]="$PAPERS model.always_run_first_token=True"
    [combined]="$PAPERS model.gate=straight_through scheduled_sampling.share_end=0.5 scheduled_sampling.ramp_steps=$((STEPS / 2)) model.routed_layers=every_other_inner model.always_run_first_token=True"
    # What configs/quickstart/stt_smollm2.yaml ships: every option that helped alone, scheduled sampling off.
    [shipped]="$PAPERS model.gate=straight_through model.routed_layers=every_other_inner model.always_run_first_token=True"
)
NAMES=("$@")
if [ ${#NAMES[@]} -eq 0 ]; then NAMES=(papers straight_through scheduled_sampling inner_layers first_token combined shipped); fi

common=(max_steps_per_epoch="$STEPS" save_every_n_steps="$STEPS" validation.every_n_steps="$STEPS" seed="$SEED")
DENSE="$WORK/dense$SUFFIX"
if [ ! -f "$DENSE/epoch_0/model-00001-of-00001.safetensors" ]; then
    echo "== dense control, seed $SEED"
    "$TUNE" run torchtune_dtf/recipes/routed_finetune.py --config configs/quickstart/dense_smollm2.yaml \
        output_dir="$DENSE" "${common[@]}"
fi
for name in "${NAMES[@]}"; do
    [ -n "${RUNS[$name]+x}" ] || { echo "unknown run $name; known: ${!RUNS[*]}" >&2; exit 2; }
    run="$name$SUFFIX"
    if [ -f "$OUT/$run.json" ]; then echo "== $run: done, skipped"; continue; fi
    echo "== $run: ${RUNS[$name]}"
    rm -rf "$WORK/$run"
    start=$(date +%s)
    # shellcheck disable=SC2086
    "$TUNE" run torchtune_dtf/recipes/routed_finetune.py --config "$CFG" output_dir="$WORK/$run" \
        "${common[@]}" checkpointer.routing_init_seed="$SEED" ${RUNS[$name]}
    train_s=$(( $(date +%s) - start ))
    # The report rebuilds the model from the config the recipe saved (overrides included).
    "$PY" -m torchtune_dtf.evaluation.routing_report \
        --dense configs/quickstart/dense_smollm2.yaml "$DENSE/epoch_0" \
        --routed "$WORK/$run/torchtune_config.yaml" "$WORK/$run/epoch_0" \
        --heldout quickstart_work/corpus/heldout.jsonl --windows 16 --seq-len 256 \
        --json "$OUT/$run.json.tmp" --meta name="$name" seed="$SEED" steps="$STEPS" train_seconds="$train_s" \
            overrides="${RUNS[$name]}"
    mv "$OUT/$run.json.tmp" "$OUT/$run.json"
done
