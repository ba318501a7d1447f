"""Which network interface gloo and TensorPipe use on this node, derived at job start.

A profile names its interfaces in NCCL's syntax (`collectives.socket_ifname`): a list of names or
name prefixes, or `^` followed by prefixes to exclude (`^lo,docker`). Only NCCL understands it: gloo
takes interface names (GLOO_SOCKET_IFNAME; it fails to start on `^lo`), TensorPipe one name. So the
rendered job exports the profile's value as NCCL_SOCKET_IFNAME only, and each trainer rank sets
GLOO_SOCKET_IFNAME and TP_SOCKET_IFNAME here, before torch starts:
- a plain list of exact names (`ib0`, `eth0,eth1`) is passed on (TensorPipe gets the first);
- otherwise (exclusions, or nothing set) the interface is the one this node reaches the master
  address through: the local end of a UDP socket connected to it (no packet is sent), matched to the
  interface holding that address. A master on this node is reached through its own address, so a
  one-node job gets the interface of that address (or `lo` for a loopback master).
When no interface can be found the variables are left unset and gloo falls back to its default
(the address of the host name).
"""

from __future__ import annotations

import fcntl
import re
import socket
import struct

SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None (no address, or no such interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route_address(master_addr: str) -> str | None:
    """This node's IPv4 address on the route to `master_addr` (nothing is sent), or None."""
    try:
        target = socket.gethostbyname(master_addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def interface_towards(master_addr: str) -> str | None:
    """The interface this node reaches `master_addr` through, or None."""
    local = route_address(master_addr)
    if local is None:
        return None
    for _, name in socket.if_nameindex():
        if interface_address(name) == local:
            return name
    return "lo" if local.startswith("127.") else None


def plain_names(spec: str | None) -> list[str]:
    """The exact interface names of an NCCL setting that lists only names (no `^` or `=` prefix,
    each an existing interface); [] when it is something else."""
    if not spec or spec.startswith(("^", "=")):
        return []
    names = [n for n in re.split(r"\s*,\s*", spec.strip()) if n]
    existing = {name for _, name in socket.if_nameindex()}
    return names if names and all(n in existing for n in names) else []


def interface_variables(master_addr: str, spec: str | None) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and TP_SOCKET_IFNAME for this rank (module docstring); {} when unknown."""
    names = plain_names(spec)
    if not names:
        found = interface_towards(master_addr)
        names = [found] if found else []
    if not names:
        return {}
    return {"GLOO_SOCKET_IFNAME": ",".join(names), "TP_SOCKET_IFNAME": names[0]}
