#!/usr/bin/env bash
# The attribution study's runs, most informative first (the driver skips every (run, seed) that has a result JSON
# and resumes one that has a checkpoint, so this can be restarted at any time):
#   1. seed 1, then seed 2, of the ranked arms at both levels ((a)–(d) and the recipe); 2. seeds 1–2 of the
#   layer-dropping line; 3. the (e) arms; 4. seed 2 of the ≈ 0.72 recipe; 5. seeds 1–2 of dense; 6. the ≈ 0.90 recipe
#   and layer dropping 4, three seeds each.
# One thread per run, so two studies can share a 2-core machine. In the background, on idle time only:
#   bash scripts/background.sh start attribution bash experiments/attribution/queue.sh
# then `python experiments/study.py aggregate experiments/attribution` as runs land.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=${PY:-.venv/bin/python}
run() {  # one (seed, run); a failure is reported and the queue goes on
    "$PY" experiments/study.py run experiments/attribution/study.yaml --no-aggregate --seeds "$1" --only "$2" \
        || echo "== $2 seed $1 failed (exit $?); going on"
}
ranked=(stt_d6_bi10_all_bias_rlr10 stt_d6_bi10_all_fixedcrit_bias_rlr10 mod_d6_bi10_all_bias_rlr10
        random_d6_bi10_all_bias stt_d5_bi6_all_nocurr_fixedcrit_bias_rlr10 stt_d5_bi6_all_nocurr_bias_rlr10
        mod_d5_bi6_all_nocurr_bias_rlr10 random_d5_bi6_all_nocurr_bias)
for seed in 1 2; do
    for name in "${ranked[@]}"; do run "$seed" "$name"; done
done
# the line that says whether routing beats dropping more layers whole, before the (e) arms' last seed
# (layer dropping 8 first: the ≈ 0.81 verdict waits on its seeds, while 7 already has two)
for name in layerdrop_8_distill layerdrop_7_distill layerdrop_10_distill; do run 1 "$name"; run 2 "$name"; done
for seed in 1 2; do
    for name in layerdrop_6_distill_bias layerdrop_5_distill_bias; do run "$seed" "$name"; done
done
run 2 stt_d6_bi10_all_rlr10
run 1 dense; run 2 dense
# the ≈ 0.90 recipe and layer dropping 4 on the test windows (§5: chosen and scored on validation in budget_cpu200)
for seed in 0 1 2; do
    for name in stt_d4_bi2_g625_all_nocurr_fixedcrit_bias_rlr10 layerdrop_4_distill_bias; do run "$seed" "$name"; done
done
echo "== attribution queue done"
