#!/usr/bin/env bash
# Packs what run_on_device.sh needs on a GPU machine that reaches no network, in pieces that fit the device
# tool's 64 MiB per call beside the working tree (~22 MiB):
#
#   bash scripts/quickstart.sh                         # once: .venv, the GGUF and the corpus under quickstart_work/
#   bash experiments/budget_h100/prepare_carry.sh      # writes .devcarry1/ … .devcarryN/ (git-ignored)
#
# The bundle holds the quickstart's SmolLM2-135M GGUF, the corpus' train/held-out files, the wheels of every
# package the recipe and the conversion import that the GPU image lacks or holds at another version (pinned to
# what .venv has, so the GPU machine runs the CPU study's library versions; only torch differs; kagglehub only
# because torchtune's CLI imports it). Then, one `run` call per piece, the last
# one starting the study (the machine keeps /tmp between calls while it is warm):
#
#   run carry=[".devcarry1"]  command: mkdir -p /tmp/carry && cp .devcarry1/part_* /tmp/carry/
#   …
#   run carry=[".devcarryN"]  command: cp .devcarryN/part_* /tmp/carry/ && PARTS=/tmp/carry \
#                                      bash experiments/budget_h100/run_on_device.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PIECE=${PIECE:-38M}
GGUF=$(find quickstart_work/downloads -name '*.gguf' | head -1)
[ -n "$GGUF" ] && [ -f quickstart_work/corpus/heldout.jsonl ] || {
    echo "no GGUF or corpus under quickstart_work/: run scripts/quickstart.sh first" >&2; exit 1; }

# The GPU image (device tool, KINDS.md) has torch, numpy, pyarrow, pandas, safetensors, sentencepiece, tiktoken,
# xxhash, requests, tqdm, psutil, pillow, lxml, pyyaml, but transformers 5 / huggingface_hub 1 / tokenizers 0.23.
NAMES='torchtune|torchao|torchdata|omegaconf|datasets|dill|multiprocess|fsspec|blobfile|pycryptodomex|huggingface[-_]hub|transformers|tokenizers|gguf|kagglehub|kagglesdk'
PINS=$($PY -m pip freeze | grep -iE "^($NAMES)==")
[ "$(echo "$PINS" | wc -l)" -eq 16 ] || { echo "expected 16 pinned packages in .venv, got:"; echo "$PINS"; exit 1; } >&2

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/bundle/wheels"
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$STAGE/bundle/wheels" $PINS
cp "$GGUF" "$STAGE/bundle/smollm2.gguf"
mkdir -p "$STAGE/bundle/corpus" && cp quickstart_work/corpus/train.jsonl quickstart_work/corpus/heldout.jsonl "$STAGE/bundle/corpus/"

tar -cf "$STAGE/bundle.tar" -C "$STAGE/bundle" .
rm -rf .devcarry[0-9]*
split -b "$PIECE" -a 1 "$STAGE/bundle.tar" "$STAGE/part_"
i=0
for part in "$STAGE"/part_*; do
    i=$((i + 1)); mkdir -p ".devcarry$i"; mv "$part" ".devcarry$i/"
    grep -qxF "/.devcarry$i/" .git/info/exclude 2>/dev/null || echo "/.devcarry$i/" >> .git/info/exclude
done
sha256sum "$STAGE/bundle.tar" | cut -d' ' -f1 > ".devcarry$i/bundle.sha256"
echo "bundle: $(du -h "$STAGE/bundle.tar" | cut -f1) in $i pieces (.devcarry1 … .devcarry$i); wheels:"
ls "$STAGE/bundle/wheels"
