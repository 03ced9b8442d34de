#!/usr/bin/env bash
# The skip_maps study's runs, seed by seed (the driver skips every (run, seed) with a result JSON and resumes one with a
# checkpoint, so this can be restarted at any time). Pause other studies while it runs (2 threads):
#   bash scripts/background.sh start skip_maps bash experiments/skip_maps/queue.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=${PY:-.venv/bin/python}
for seed in 0 1 2; do
    for name in recipe_linear recipe_bias recipe_d4_bi7_bias dense; do
        "$PY" experiments/study.py run experiments/skip_maps/study.yaml --no-aggregate --seeds "$seed" --only "$name" \
            || echo "== $name seed $seed failed (exit $?); going on"
    done
done
echo "== skip_maps queue done"
