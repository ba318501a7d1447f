#!/usr/bin/env bash
# Stop the one-host Slurm dev cluster started by slurm/up.sh: only the daemons whose PID files it wrote
# (and munged only if up.sh started it). Usage: bash slurm/down.sh [STATE_DIR]
set -uo pipefail
STATE=${1:-/var/tmp/miles-slurm}
stop() {  # stop PIDFILE: TERM, wait up to 10 s, then KILL that one PID
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$f"
}
for f in "$STATE"/run/slurmd-*.pid; do stop "$f"; done
stop "$STATE/run/slurmctld.pid"
stop "$STATE/run/slurmdbd.pid"
stop "$STATE/run/mysqld.pid"
if [ -f "$STATE/run/munged.ours" ]; then stop /run/munge/munged.pid; rm -f "$STATE/run/munged.ours"; fi
echo "slurm dev cluster stopped"
