"""Write the configuration of the one-host Slurm dev cluster (slurm.conf, slurmdbd.conf, cgroup.conf).

Several logical nodes run on this host, each its own `slurmd -N nX` (Debian builds slurmd with
MULTIPLE_SLURMD). Every daemon port is asked from the OS when the files are written, so the cluster
never collides with a fixed port in use. Standard library only: it runs before the venv exists.

    python3 slurm/conf.py --state /var/tmp/miles-slurm --nodes 4 --etc /etc/slurm
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

MARKER = "# written by miles slurm/conf.py"


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback, as the OS hands them out."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def free_range(n: int) -> int:
    """First port of n consecutive free loopback ports (slurmd takes a range: Port=[a-b])."""
    for _ in range(200):
        base = free_ports(1)[0]
        if base + n > 65535:
            continue
        try:
            held = []
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise SystemExit(f"no {n} consecutive free ports found on 127.0.0.1")


def slurm_conf(state: Path, nodes: int, cpus: int, mem_mb: int, ports: dict[str, int]) -> str:
    """slurm.conf text: one partition `debug` of `nodes` logical nodes on 127.0.0.1, with accounting."""
    host = socket.gethostname()
    first, last = ports["slurmd"], ports["slurmd"] + nodes - 1
    return f"""{MARKER}
ClusterName=miles-dev
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports["slurmctld"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool/%n
TmpFS={state}/tmp/%n
SlurmctldPidFile={state}/run/slurmctld.pid
SlurmdPidFile={state}/run/slurmd-%n.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobRequeue=1
MinJobAge=300
KillWait=5
InactiveLimit=0
MaxArraySize=1001
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports["slurmdbd"]}
JobCompType=jobcomp/none
NodeName=n[1-{nodes}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{first}-{last}] CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes=n[1-{nodes}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def slurmdbd_conf(state: Path, ports: dict[str, int]) -> str:
    """slurmdbd.conf text: the private MariaDB on its own port, no password (socket-less TCP, loopback)."""
    return f"""{MARKER}
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={ports["slurmdbd"]}
SlurmUser=root
PidFile={state}/run/slurmdbd.pid
LogFile={state}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports["mysql"]}
StorageUser=root
StorageLoc=slurm_acct_db
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", required=True, type=Path, help="directory for spool, state, logs, database")
    ap.add_argument("--etc", default=Path("/etc/slurm"), type=Path, help="where Slurm reads its config")
    ap.add_argument("--nodes", type=int, default=4, help="logical nodes (>= 3 for a 1+2 het job)")
    ap.add_argument("--cpus", type=int, default=4, help="CPUs each logical node declares")
    ap.add_argument("--mem-mb", type=int, default=4096, help="memory each logical node declares")
    args = ap.parse_args()
    conf = args.etc / "slurm.conf"
    if conf.exists() and MARKER not in conf.read_text():
        raise SystemExit(f"{conf} exists and was not written by this script; refusing to overwrite it")
    ctld, dbd, mysql = free_ports(3)
    slurmd = free_range(args.nodes)
    ports = {"slurmctld": ctld, "slurmdbd": dbd, "mysql": mysql, "slurmd": slurmd}
    for sub in ("ctld", "run", "log", *(f"spool/n{i}" for i in range(1, args.nodes + 1))):
        (args.state / sub).mkdir(parents=True, exist_ok=True)
    for i in range(1, args.nodes + 1):
        (args.state / "tmp" / f"n{i}").mkdir(parents=True, exist_ok=True)
    args.etc.mkdir(parents=True, exist_ok=True)
    conf.write_text(slurm_conf(args.state, args.nodes, args.cpus, args.mem_mb, ports))
    dbd_conf = args.etc / "slurmdbd.conf"
    dbd_conf.write_text(slurmdbd_conf(args.state, ports))
    os.chmod(dbd_conf, 0o600)
    (args.etc / "cgroup.conf").write_text(f"{MARKER}\nCgroupPlugin=autodetect\n")
    (args.state / "mysql.port").write_text(str(mysql))
    print(f"wrote {conf} ({args.nodes} nodes, slurmctld port {ctld}, slurmdbd {dbd}, mysql {mysql})")


if __name__ == "__main__":
    main()
