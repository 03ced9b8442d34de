#!/usr/bin/env bash
# Run long jobs (studies) in the background on idle time only, and pause them while timing anything:
#
#   bash scripts/background.sh start NAME COMMAND...   # e.g. start attribution bash experiments/attribution/queue.sh
#   bash scripts/background.sh pause | resume | status
#
# Each job gets its own session (setsid), so it outlives the shell that started it. That also makes it its own
# Linux scheduling group (autogroup), and `nice` only orders processes *inside* a group: a niced job still takes
# half of a 2-core machine from a test run in another session. So the job's autogroup itself is set to nice 19
# (its children inherit the group). Logs and process-group ids go to $BACKGROUND_DIR (default
# quickstart_work/background): NAME.log, NAME.pgid. Why and how to time next to them: docs/studies.md.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${BACKGROUND_DIR:-quickstart_work/background}
mkdir -p "$dir"

live_groups() {  # NAME PGID of every job whose process group still has a process
    for file in "$dir"/*.pgid; do
        [ -e "$file" ] || continue
        pgid=$(cat "$file")
        if pgrep -g "$pgid" > /dev/null; then echo "$(basename "$file" .pgid) $pgid"; fi
    done
}

# A process's scheduling group as the kernel shows it; some kernels have the file but leave it empty.
autogroup_of() {  # PID WHAT-TO-SAY-IF-UNREADABLE
    local group
    group=$(cat "/proc/$1/autogroup" 2>/dev/null) || { echo "$2"; return; }
    echo "${group:-no autogroup shown}"
}

case "${1:-}" in
    start)
        [ $# -ge 3 ] || { echo "usage: $0 start NAME COMMAND..." >&2; exit 2; }
        name=$2; shift 2
        if [ -e "$dir/$name.pgid" ] && pgrep -g "$(cat "$dir/$name.pgid")" > /dev/null; then
            echo "error: $name is already running (process group $(cat "$dir/$name.pgid"))" >&2; exit 1
        fi
        [ -e "$dir/$name.log" ] && mv "$dir/$name.log" "$dir/$name.$(date +%Y%m%d-%H%M%S).log"
        setsid "$@" > "$dir/$name.log" 2>&1 < /dev/null &
        pid=$!
        echo "$pid" > "$dir/$name.pgid"  # a setsid leader's pid is its process group's id
        # Until the child has called setsid() it is still in this shell's autogroup, and lowering that would
        # lower this shell: wait for the new session. Its autogroup is then the job's alone, and lowering it
        # lowers every process the job starts later.
        for _ in $(seq 100); do
            [ "$(ps -o sid= -p "$pid" 2>/dev/null | tr -d ' ')" = "$pid" ] && break
            sleep 0.05
        done
        if [ "$(ps -o sid= -p "$pid" 2>/dev/null | tr -d ' ')" = "$pid" ] && [ -w "/proc/$pid/autogroup" ]; then
            echo 19 > "/proc/$pid/autogroup"
        fi
        echo "== $name: process group $pid, $(autogroup_of "$pid" 'no autogroup'), log $dir/$name.log"
        ;;
    pause|resume)
        signal=$([ "$1" = pause ] && echo STOP || echo CONT)
        live_groups | while read -r name pgid; do kill -"$signal" -- "-$pgid"; echo "== $name: $1d"; done
        ;;
    status)
        live_groups | while read -r name pgid; do
            state=$(ps -o stat= -p "$pgid" 2>/dev/null | cut -c1 || true)
            echo "$name: process group $pgid$([ "$state" = T ] && echo ' (paused)'), $(autogroup_of "$pgid" 'leader gone')"
        done
        ;;
    *)
        echo "usage: $0 start NAME COMMAND... | pause | resume | status" >&2; exit 2
        ;;
esac
