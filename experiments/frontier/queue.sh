#!/usr/bin/env bash
# Runs the frontier study in pieces, most informative first, one (run, seed) at a time, resumably: finished runs
# are skipped, an interrupted training resumes from its last checkpoint. Two workers share the list: a (run, seed)
# another worker is running is skipped (flock on a file per pair; the lock ends with its process, so a run cut
# off by a machine stop is taken up again next time):
#   setsid nohup bash experiments/frontier/queue.sh > quickstart_work/studies/frontier_w1.log 2>&1 &
#   setsid nohup bash experiments/frontier/queue.sh > quickstart_work/studies/frontier_w2.log 2>&1 &
# One thread each: a second torch process on a 2-core machine otherwise thrashes both.
#
# Order: first what the issue's targets rest on (three seeds of each baseline and of the best recipe per FLOP
# level, found so far by block-influence placement), then the papers' recipe (the 70 % gap target), the
# surprise-vs-MoD question, the papers' claims (one seed first), the technique ablations, the rest.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
LOCKS=quickstart_work/studies/frontier_locks
mkdir -p "$LOCKS"
ORDER=(
  # ≈ 0.81 of dense: baselines and the best recipe so far, three seeds
  dense:0 dense:1 dense:2 layerdrop_7:0 layerdrop_7:1 layerdrop_7:2 random_50:0 random_50:1 random_50:2
  stt_bi14_all:0 mod_bi14_all:0 stt_bi14_all:1 mod_bi14_all:1 stt_bi14_all:2 mod_bi14_all:2
  # graded capacity (can token routing beat dropping whole layers?), the papers' recipe and a first read of
  # ≈ 0.90 (cheap baselines first), then the remaining seeds
  stt_bi14_graded_all:0 stt_papers_50:0 layerdrop_4:0 random_75:0 stt_bi8_all:0
  stt_bi14_graded_all:1 stt_bi14_graded_all:2 stt_papers_50:1 stt_papers_50:2
  # ≈ 0.72, then the remaining seeds of both levels
  layerdrop_10:0 stt_bi20_all:0 random_25:0
  # γ 0.1 / 0.9 on the 14 layers: the last step between graded capacity and layer dropping
  stt_bi14_graded10_all:0
  # a faster-learning causal router: the student's gap to its teacher on the graded recipe
  stt_bi14_graded_all_rlr10:0
  # seed 0 beat layerdrop_7 (−0.034; the student's gap to its teacher fell from 0.076 to 0.016): the other seeds
  stt_bi14_graded_all_rlr10:1 stt_bi14_graded_all_rlr10:2
  # the faster routers at the other two levels, then the remaining seeds of both levels
  stt_bi8_all_rlr10:0 stt_bi20_all_rlr10:0
  # graded capacity at ≈ 0.90 (even the teacher of stt_bi8_all trails layerdrop_4), then the baselines' third seeds
  stt_bi8_graded_all_rlr10:0 random_25:1 layerdrop_4:2 layerdrop_10:2 random_75:2 random_25:2
  layerdrop_4:1 stt_bi8_all:1 random_75:1 layerdrop_10:1 stt_bi20_all:1 random_25:1
  layerdrop_4:2 stt_bi8_all:2 random_75:2 layerdrop_10:2 stt_bi20_all:2 random_25:2
  stt_bi8_all_rlr10:1 stt_bi20_all_rlr10:1 stt_bi8_all_rlr10:2 stt_bi20_all_rlr10:2
  # the papers' claims, one seed first
  sdt_50:0 stt_dynamic:0 sdt_50_prior0_25:0 stt_50_prior0_25:0 lora_stt_50:0 stt_50:0 mod_50:0
  # every-other placement with all techniques, and the ablations
  stt_50_all:1 mod_50_all:1 stt_50_all:2 mod_50_all:2
  stt_50_kv:0 stt_50_pred:0 stt_50_curr:0 stt_50_distill:0 mod_50_kv:0 mod_50_curr:0 mod_50_distill:0
  stt_75_all:0 mod_75_all:0 stt_25_all:0 mod_25_all:0
  sdt_50:1 stt_dynamic:1 sdt_50:2 stt_dynamic:2 stt_50:1 mod_50:1 stt_50:2 mod_50:2
)
for item in "${ORDER[@]}"; do
    name=${item%%:*} seed=${item##*:}
    flock -n -E 75 "$LOCKS/$item.lock" \
        .venv/bin/python experiments/study.py run experiments/frontier/study.yaml --seeds "$seed" --only "$name" --no-aggregate
    [ $? -eq 75 ] && echo "== $item: another worker runs it"
done
.venv/bin/python experiments/study.py aggregate experiments/frontier
