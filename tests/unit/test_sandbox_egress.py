"""Egress for tasks that allow the internet (miles/agentic/sandbox/egress.py): a sandbox with
`network: egress` runs in a network namespace of pasta's whose packets leave through pasta. The tests
send nothing off this machine: with `egress_to_host` the gateway's address reaches this host's
loopback, where a test server answers. Without egress the same request finds no route; with egress
but without the mapping, the host's loopback services stay out of reach from the sandbox's own
loopback. A Harbor task whose verifier downloads what it checks scores 1 with egress and fails with
`--internet off`, its row saying the network was missing."""

from __future__ import annotations

import asyncio
import functools
import http.server
import shutil
import threading
from pathlib import Path

import pytest

from miles.agentic.harbor.check import check_task, report
from miles.agentic.harbor.sandboxes import episode_settings, offline_reason
from miles.agentic.harbor.task import load_task
from miles.agentic.sandbox.bwrap import BwrapSandbox, BwrapSettings
from miles.agentic.sandbox.container import ContainerSandboxConfig
from miles.agentic.sandbox.egress import egress_missing, pasta_argv

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or bool(egress_missing()),
    reason=f"needs bubblewrap and egress ({egress_missing() or 'bwrap missing'})",
)

GATEWAY = (
    "python3 -c \"import socket, struct; rows = [r.split() for r in open('/proc/net/route')][1:]; "
    "g = [r[2] for r in rows if r[1] == '00000000']; "
    "print(socket.inet_ntoa(struct.pack('<L', int(g[0], 16))) if g else 'none')\""
)
FETCH = (
    'python3 -c "import sys, urllib.request as u; print(u.urlopen(sys.argv[1], timeout=5).read().decode())"'
)


@pytest.fixture
def host_server(tmp_path):
    """A file server on this host's loopback: (its port, the folder it serves)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv.server_address[1], root
    srv.shutdown()
    srv.server_close()


def test_egress_reaches_out_and_the_hosts_loopback_stays_closed(host_server) -> None:
    port, root = host_server
    (root / "hello.txt").write_text("from outside the sandbox")

    async def go(settings: BwrapSettings, url: str) -> tuple[str, str]:
        async with BwrapSandbox(settings) as sb:
            gw = (await sb.exec(GATEWAY)).stdout.strip()
            got = await sb.exec(f"{FETCH} {url.format(gw=gw, port=port)} 2>&1 | tail -1")
            return gw, got.stdout.strip()

    gw, out = asyncio.run(
        go(BwrapSettings(network="egress", egress_to_host=True), "http://{gw}:{port}/hello.txt")
    )
    assert gw != "none" and out == "from outside the sandbox"
    gw, out = asyncio.run(go(BwrapSettings(network="none"), "http://192.0.2.1:{port}/hello.txt"))
    assert gw == "none" and "Network is unreachable" in out  # no route: nothing is sent
    _, out = asyncio.run(go(BwrapSettings(network="egress"), "http://127.0.0.1:{port}/hello.txt"))
    assert "Connection refused" in out  # the sandbox's loopback is its own
    assert "--no-map-gw" in pasta_argv() and "--no-map-gw" not in pasta_argv(to_host=True)


def test_no_default_route_means_no_egress(tmp_path) -> None:
    table = tmp_path / "route"
    table.write_text("Iface\tDestination\tGateway\tFlags\nlo\t0000007F\t00000000\t0001\n")
    assert egress_missing(str(table)) == "this node has no default route"
    table.write_text("Iface\tDestination\tGateway\tFlags\neth0\t00000000\t010200C0\t0003\n")
    assert egress_missing(str(table)) in ("", "pasta is not installed (Debian package passt)")


VERIFIER = """#!/bin/bash
mkdir -p /logs/verifier
gw=$({gateway})
expected=$({fetch} "http://$gw:{port}/expected.txt")
if [ "$expected" = "$(cat /app/answer.txt 2>/dev/null)" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
echo "expected: $expected"
"""


def _downloading_task(root: Path, port: int, allow_internet: bool) -> Path:
    files = {
        "task.toml": f'version = "1.0"\n[verifier]\ntimeout_sec = 30\n[environment]\nallow_internet = {str(allow_internet).lower()}\n',
        "instruction.md": "Write 42 to /app/answer.txt.\n",
        "environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\n",
        "tests/test.sh": VERIFIER.format(gateway=GATEWAY, fetch=FETCH, port=port),
        "solution/solve.sh": "#!/bin/bash\necho 42 > /app/answer.txt\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture(params=["local", "apptainer"])
def backend(request) -> ContainerSandboxConfig | None:
    """None (bubblewrap), or apptainer with the test images, egress reaching the host's loopback."""
    if request.param == "local":
        return None
    images = request.getfixturevalue("apptainer_images")
    return ContainerSandboxConfig(runtime="apptainer", image_dir=images, egress_to_host=True)


def test_a_task_that_allows_the_internet_gets_it_on_either_backend(tmp_path, host_server, backend) -> None:
    """The verifier downloads the expected answer: with egress the oracle scores 1 (apptainer: pasta
    connected to the container's own network namespace), with --internet off it fails and says why."""
    port, www = host_server
    (www / "expected.txt").write_text("42\n")
    task = load_task(_downloading_task(tmp_path / "fetches", port, allow_internet=True))
    to_host = BwrapSettings(egress_to_host=True)
    ok = asyncio.run(check_task(task, to_host, backend, internet="auto"))
    assert ok.passed and ok.oracle.reward == 1.0 and ok.nothing.reward == 0.0, report([ok])[0]
    off = asyncio.run(check_task(task, to_host, backend, internet="off"))
    assert not off.passed and "ran without network: internet: off" in report([off])[0]


def test_the_network_an_episode_gets(tmp_path, host_server) -> None:
    port, _ = host_server
    task = load_task(_downloading_task(tmp_path / "fetches", port, allow_internet=True))
    to_host = BwrapSettings(egress_to_host=True)
    assert episode_settings(task, to_host, "auto").network == "egress" and offline_reason(task, "auto") == ""
    assert episode_settings(task, to_host, "off").network == "none"
    assert episode_settings(task, to_host).network == "none"  # the tests' default: MILES_TASKS_INTERNET=off
    enroot = ContainerSandboxConfig(runtime="enroot")
    assert "network: none (network: host gives them the node's)" in offline_reason(task, "auto", enroot)
    assert offline_reason(task, "auto", ContainerSandboxConfig(runtime="apptainer")) == ""


def test_a_task_that_does_not_allow_the_internet_is_offline(tmp_path, host_server) -> None:
    port, www = host_server
    (www / "expected.txt").write_text("42\n")
    to_host = BwrapSettings(egress_to_host=True)
    closed = load_task(_downloading_task(tmp_path / "closed", port, allow_internet=False))
    assert (
        episode_settings(closed, to_host, "auto").network == "none" and offline_reason(closed, "auto") == ""
    )
    shut = asyncio.run(check_task(closed, to_host, internet="auto"))
    assert not shut.passed and shut.oracle.reward == 0.0 and "without network" not in report([shut])[0]
