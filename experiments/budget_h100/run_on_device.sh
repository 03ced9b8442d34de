#!/usr/bin/env bash
# Train and score the runs of experiments/budget_h100 on one GPU machine that has no network.
#
# Run from the repo root, with $PARTS holding the pieces that prepare_carry.sh made (part_a, part_b, …, and
# bundle.sha256): the bundle is reassembled and checked, its wheels installed to /tmp/site (ahead of the image's
# packages on PYTHONPATH), and the GGUF converted exactly as scripts/quickstart.sh converts it. Every (run, seed)
# is its own `study.py run --only NAME --seeds S` process and all start at once: eager PyTorch at 135M is bound
# by kernel launches, so one run leaves the GPU mostly idle. Each process is stopped after $LIMIT seconds; a run
# that finishes writes its JSON under experiments/budget_h100/ as the frontier study does.
set -u
PY=${PY:-python3}
PARTS=${PARTS:-/tmp/carry}
LIMIT=${LIMIT:-480}
STUDIES=${STUDIES:-"experiments/budget_h100/study.yaml experiments/budget_h100/anchor60.yaml"}
LOGS=${LOGS:-/tmp/budget_logs}
BUNDLE=/tmp/budget_bundle
mkdir -p "$LOGS"

[ -z "${NO_WHEELS:-}" ] && export PYTHONPATH=/tmp/site   # the carried versions ahead of the image's
if [ -z "${SKIP_SETUP:-}" ]; then
    cat "$PARTS"/part_* > /tmp/budget_bundle.tar
    echo "$(cat "$PARTS/bundle.sha256")  /tmp/budget_bundle.tar" | sha256sum -c || { echo "FAIL bundle checksum"; exit 1; }
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE" && tar -xf /tmp/budget_bundle.tar -C "$BUNDLE" || { echo "FAIL bundle"; exit 1; }
    if [ -z "${NO_WHEELS:-}" ]; then   # (NO_WHEELS=1: the python in PY has them, as a local dry run's does)
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$BUNDLE"/wheels/*.whl || { echo "FAIL wheels"; exit 1; }
    fi
    mkdir -p quickstart_work && cp -r "$BUNDLE/corpus" quickstart_work/
    $PY -m torchtune_dtf.offline.gguf_to_hf --gguf "$BUNDLE/smollm2.gguf" --out quickstart_work/smollm2_hf \
        > "$LOGS/convert.log" 2>&1 || { echo "FAIL conversion"; tail -20 "$LOGS/convert.log"; exit 1; }
    echo "converted: $(ls quickstart_work/smollm2_hf | tr '\n' ' ')"
fi

export OMP_NUM_THREADS=1   # the held-out evaluation runs on the CPU, in every process at once
for study in $STUDIES; do
    plan=$($PY -c "import sys; sys.path.insert(0, '.'); from experiments.spec import load_study; s = load_study(sys.argv[1])
print(' '.join(r['name'] for r in s['runs'])); print(' '.join(map(str, s['seeds'])))" "$study") || { echo "FAIL $study"; exit 1; }
    names=$(echo "$plan" | sed -n 1p); seeds=$(echo "$plan" | sed -n 2p)
    tag=$(basename "$study" .yaml)
    for name in $names; do
        for seed in $seeds; do
            HF_DATASETS_CACHE=/tmp/hf_datasets/${tag}_${name}_${seed} timeout "$LIMIT" $PY experiments/study.py run "$study" --only "$name" --seeds "$seed" --no-aggregate \
                > "$LOGS/${tag}_${name}_${seed}.log" 2>&1 &
            sleep 1   # study.json is written by every process: keep the writes apart
        done
    done
done
wait
for log in "$LOGS"/*_[0-9].log; do echo "$(basename "$log"): $(grep -E 'wrote|FAILED' "$log" | tail -1)"; done
# The device tool brings back what is under $OUT: every run's JSON and the logs, in one file.
if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/results.tgz" experiments/budget_h100 "$LOGS" 2>/dev/null
    echo "results: $OUT/results.tgz ($(du -h "$OUT/results.tgz" | cut -f1))"
fi
