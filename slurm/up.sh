#!/usr/bin/env bash
# Start the one-host Slurm dev cluster: munge, a private MariaDB, slurmdbd, slurmctld and one slurmd per
# logical node (n1..nN on 127.0.0.1). Idempotent: a running cluster is left alone; daemons already up are
# not started twice. Usage: bash slurm/up.sh [STATE_DIR] [NODES]   (defaults /var/tmp/miles-slurm, 4)
set -euo pipefail
STATE=${1:-/var/tmp/miles-slurm}
NODES=${2:-4}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$STATE/run" "$STATE/log"

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local t=$1 what=$2; shift 2
  for _ in $(seq $((t * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "slurm/up.sh: $what did not come up within ${t}s; see $STATE/log/" >&2; return 1
}

if command -v sinfo >/dev/null && alive "$STATE/run/slurmctld.pid" && alive "$STATE/run/slurmdbd.pid" \
   && alive "$STATE/run/mysqld.pid" && [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated)')" -ge "$NODES" ]; then
  echo "slurm dev cluster already up: $(sinfo -h -o '%P %D %T' | tr '\n' ' ')"; exit 0
fi
for bin in slurmctld slurmd slurmdbd munged mariadbd; do
  command -v "$bin" >/dev/null || { echo "slurm/up.sh: $bin missing; install: apt-get install slurmctld slurmd slurm-client slurmdbd munge mariadb-server libpmix-dev" >&2; exit 1; }
done

# munge: the key comes with the Debian package; munged runs as user munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [ -s /etc/munge/munge.key ] || { mungekey --create --force 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$STATE/run/munged.ours"
  wait_for 10 munged bash -c 'munge -n | unmunge'
fi

# configuration: regenerated only while no daemon of ours runs (it picks fresh ports)
if ! alive "$STATE/run/slurmdbd.pid" && ! alive "$STATE/run/slurmctld.pid"; then
  python3 "$HERE/conf.py" --state "$STATE" --nodes "$NODES"
fi
MYSQL_PORT=$(cat "$STATE/mysql.port")

if ! alive "$STATE/run/mysqld.pid"; then
  [ -d "$STATE/mysql/mysql" ] || mariadb-install-db --datadir="$STATE/mysql" --user=root >"$STATE/log/mysql-init.log" 2>&1
  # setsid: the database must outlive the shell that started it (slurmdbd and slurmd daemonize alone)
  setsid mariadbd --datadir="$STATE/mysql" --user=root --bind-address=127.0.0.1 --port="$MYSQL_PORT" \
    --socket="$STATE/run/mysql.sock" --pid-file="$STATE/run/mysqld.pid" --skip-grant-tables \
    --log-error="$STATE/log/mysqld.log" >/dev/null 2>&1 &
  wait_for 30 mariadb test -S "$STATE/run/mysql.sock"
fi
alive "$STATE/run/slurmdbd.pid" || { slurmdbd; wait_for 30 slurmdbd sacctmgr -n list cluster; }
sacctmgr -i -Q add cluster miles-dev >/dev/null 2>&1 || true
alive "$STATE/run/slurmctld.pid" || { slurmctld; wait_for 30 slurmctld scontrol ping; }
for i in $(seq 1 "$NODES"); do
  alive "$STATE/run/slurmd-n$i.pid" || slurmd -N "n$i"
done
wait_for 60 "all $NODES nodes" bash -c "[ \$(sinfo -h -N -o %T | grep -cE '^(idle|mixed|allocated)') -ge $NODES ]"
echo "slurm dev cluster up: $(sinfo -h -o '%P %D %T %N' | tr '\n' ' ')"
