"""Every shipped profile's network settings, as a trainer rank gets them: the environment the job
renders (miles.cluster.collectives) and the interfaces the actor bootstrap derives on this host
(miles.cluster.network), under which two real processes open a TCPStore and a gloo group and
all-reduce. NCCL's `^lo,docker` given to gloo as it is (what the profiles exported before) fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from miles.cluster.collectives import collectives_env
from miles.cluster.environment import JobEnvironment
from miles.cluster.network import interface_variables, plain_names
from miles.config.profile import known_profiles, load_profile
from miles.processes import free_port

RANK = """
import datetime, os, sys, torch, torch.distributed as dist
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
assert t.item() == 3.0, t
dist.destroy_process_group()
print("ok", os.environ.get("GLOO_SOCKET_IFNAME"))
"""


def _gloo_pair(env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(port)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for r in (0, 1)
    ]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _rank_env(rendered: dict[str, str]) -> dict[str, str]:
    """What the actor bootstrap exports for a rank whose master is this host (loopback)."""
    base = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    job = JobEnvironment.from_env({**base, **rendered})
    return {**base, **rendered, **interface_variables("127.0.0.1", job.socket_ifname), "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("profile", known_profiles())
def test_each_profiles_rendered_network_settings_open_a_gloo_group(profile, tmp_path) -> None:
    rendered = collectives_env(load_profile(profile), str(tmp_path))
    assert "GLOO_SOCKET_IFNAME" not in rendered and "TP_SOCKET_IFNAME" not in rendered  # NCCL's only
    env = _rank_env(rendered)
    for name in filter(None, [env.get("GLOO_SOCKET_IFNAME"), env.get("TP_SOCKET_IFNAME")]):
        assert not name.startswith(("^", "=")), name
    results = _gloo_pair(env)
    assert all(r.returncode == 0 for r in results), [r.stderr[-1500:] for r in results]


def test_nccls_exclusion_syntax_given_to_gloo_fails() -> None:
    """The control: the value the GPU profiles exported to gloo before."""
    base = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
    results = _gloo_pair({**base, "GLOO_SOCKET_IFNAME": "^lo,docker", "OMP_NUM_THREADS": "1"})
    assert any(r.returncode != 0 for r in results)


def test_plain_interface_names_pass_through_and_patterns_are_resolved() -> None:
    assert plain_names("lo") == ["lo"] and plain_names("^lo,docker") == [] and plain_names("=eth0") == []
    assert plain_names("no-such-interface0") == []  # a prefix or a name of another node: resolved here
    assert interface_variables("127.0.0.1", "lo") == {"GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo"}
    assert interface_variables("127.0.0.1", "^lo,docker")["GLOO_SOCKET_IFNAME"] == "lo"
