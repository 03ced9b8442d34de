#!/usr/bin/env bash
# Runs the frontier study in pieces, one (run, seed) at a time, resumably: finished runs are skipped, an
# interrupted training resumes from its last checkpoint. Two workers share the list: a (run, seed) another
# worker is running is skipped (flock on a file per pair; the lock ends with its process, so a run cut off by a
# machine stop is taken up again next time):
#   setsid nohup bash experiments/frontier/queue.sh > quickstart_work/studies/frontier_w1.log 2>&1 &
#   setsid nohup bash experiments/frontier/queue.sh > quickstart_work/studies/frontier_w2.log 2>&1 &
# One thread each: a second torch process on a 2-core machine otherwise thrashes both.
#
# The priority list is experiments/frontier/queue.txt, read again before every run, so that a result can
# reorder what comes next without stopping a worker mid-run. A worker takes the first pair that has no JSON
# under experiments/frontier/runs/, is not locked by the other worker and has not failed in this worker; it
# stops when none is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
STUDY=experiments/frontier
LOCKS=quickstart_work/studies/frontier_locks
mkdir -p "$LOCKS"
declare -A failed=()

pending() {  # the list's pairs in order, without comments, finished runs or this worker's failures
    local item
    for item in $(sed 's/#.*//' "$STUDY/queue.txt"); do
        [[ $item == *:* ]] || { echo "queue.txt: '$item' is not run:seed" >&2; continue; }
        [ -f "$STUDY/runs/${item%%:*}__seed${item##*:}.json" ] && continue
        [ -n "${failed[$item]:-}" ] && continue
        echo "$item"
    done
}

while :; do
    ran=0
    for item in $(pending); do
        flock -n -E 75 "$LOCKS/$item.lock" \
            .venv/bin/python experiments/study.py run "$STUDY/study.yaml" \
            --seeds "${item##*:}" --only "${item%%:*}" --no-aggregate
        status=$?
        if [ $status -eq 75 ]; then echo "== $item: another worker runs it"; continue; fi
        if [ $status -ne 0 ]; then echo "== $item: failed (exit $status), not retried by this worker"; failed[$item]=1; fi
        ran=1
        break  # read the list again: it may have been reordered while this run trained
    done
    [ $ran -eq 1 ] || break
done
.venv/bin/python experiments/study.py aggregate "$STUDY"
