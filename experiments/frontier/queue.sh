#!/usr/bin/env bash
# Runs the frontier study in pieces, most informative first, one (run, seed) at a time, resumably: finished runs
# are skipped, an interrupted training resumes from its last checkpoint. In the background:
#   setsid nohup bash experiments/frontier/queue.sh 0 > quickstart_work/studies/frontier_seed0.log 2>&1 &
# Argument: the seeds to run (default 0 1 2). One thread: a second torch process on a 2-core machine otherwise
# thrashes both.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SEEDS=("${@:-0 1 2}")
ORDER=(dense layerdrop_7 random_50 mod_50_all stt_50_all stt_bi14_all mod_bi14_all stt_papers_50 stt_50 mod_50
       stt_50_kv stt_50_pred stt_50_curr stt_50_distill mod_50_kv mod_50_curr mod_50_distill
       sdt_50 stt_dynamic layerdrop_4 stt_bi8_all random_75 stt_75_all mod_75_all layerdrop_10 stt_bi20_all random_25
       stt_25_all mod_25_all
       sdt_50_prior0_25 stt_50_prior0_25 lora_stt_50)
for seed in ${SEEDS[*]}; do
    for name in "${ORDER[@]}"; do
        .venv/bin/python experiments/study.py run experiments/frontier/study.yaml --seeds "$seed" --only "$name" --no-aggregate
    done
done
.venv/bin/python experiments/study.py aggregate experiments/frontier
