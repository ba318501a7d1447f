"""Network for sandboxes whose commands may reach out (a Harbor task's `allow_internet`).

A sandbox with `network: egress` runs in a network namespace of its own that `pasta` (Debian package
passt, rootless) connects to the node's network: the namespace has a copy of the node's address and
default route, its traffic leaves through pasta's sockets, and it has its own loopback, so the
node's loopback services (the router, engines, this process' servers) stay out of reach. Pasta runs
with no port forwarding either way (`-t none -u none -T none -U none`) and with `--no-map-gw`, so the
gateway's address is the real gateway, not a door to the node's loopback; `to_host` keeps pasta's
default mapping (the gateway's address reaches the node's loopback), which tests use to show that
packets leave the namespace without sending any off the machine.

Egress is given only where the node has it: a default route (/proc/net/route) and pasta installed;
otherwise `egress_missing` says why, and episodes run without network.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

PASTA = "pasta"


def egress_missing(route_table: str | None = None) -> str:
    """Why this node cannot give sandboxes egress, or "" when it can: asked of the node once per
    process (every episode's settings ask it), or of the route table `route_table` (a file in
    /proc/net/route's format)."""
    return _node_egress() if route_table is None else _egress(route_table)


@functools.cache
def _node_egress() -> str:
    return _egress("/proc/net/route")


def _egress(route_table: str) -> str:
    try:
        rows = [line.split() for line in Path(route_table).read_text().splitlines()[1:]]
    except OSError:
        rows = []
    if not any(len(r) > 2 and r[1] == "00000000" and r[0] != "lo" for r in rows):
        return "this node has no default route"
    if shutil.which(PASTA) is None:
        return "pasta is not installed (Debian package passt)"
    return ""


def pasta_argv(to_host: bool = False) -> list[str]:
    """The prefix running a command in a new network namespace with egress (module docstring)."""
    argv = [PASTA, "--config-net", "--quiet", "-t", "none", "-u", "none", "-T", "none", "-U", "none"]
    return [*argv, *([] if to_host else ["--no-map-gw"]), "--"]
