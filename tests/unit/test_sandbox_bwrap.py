"""The local bubblewrap sandbox really isolates: network, filesystem, run directory, limits, cleanup."""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest
from owned_processes import left_after_owner_killed, pids_running

from miles.agentic.sandbox.base import Limits, SandboxError, SandboxStartError
from miles.agentic.sandbox.bwrap import BwrapSandbox, BwrapSettings, bwrap_argv, owner_prefix, sweep_orphans
from miles.agentic.sandbox.pool import SandboxPool

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


@pytest.fixture
def tmp_path():
    """A world-searchable scratch directory: the sandbox user (65534 when tests run as root) must
    reach the sandbox root, and the run-directory test must fail only because of the sandbox."""
    path = Path(tempfile.mkdtemp(prefix="miles-sbtest-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def settings(tmp_path: Path, **limits) -> BwrapSettings:
    return BwrapSettings(root=str(tmp_path / "sandboxes"), limits=Limits(**limits))


def run(coro):
    return asyncio.run(coro)


def test_runs_commands_in_its_own_writable_directory(tmp_path):
    async def episode():
        async with BwrapSandbox(settings(tmp_path)) as sb:
            await sb.write_file("in/task.txt", "6 7")
            r = await sb.exec("read a b < in/task.txt; echo $((a * b)) > out.txt; pwd")
            return r, await sb.read_file("out.txt"), await sb.exec(["cat"], stdin="piped")

    r, out, cat = run(episode())
    assert r.ok and r.stdout.strip() == "/sandbox"
    assert out == b"42\n"
    assert cat.stdout == "piped"


def test_no_network_from_inside(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"

    async def episode():
        async with BwrapSandbox(settings(tmp_path)) as sb:
            return await sb.exec(["python3", "-c", code])

    try:
        r = run(episode())
        # the same connection from outside works, so the refusal above is the sandbox's doing
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        server.close()
    assert r.returncode != 0 and "connected" not in r.stdout
    assert "Network is unreachable" in r.stderr or "Connection refused" in r.stderr


def test_cannot_write_outside_nor_read_the_run_directory(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "secret.txt").write_text("do not read")
    (run_dir / "secret.txt").chmod(0o644)
    home_file = Path.home() / ".miles-sandbox-probe"

    async def episode():
        async with BwrapSandbox(settings(tmp_path)) as sb:
            writes = await sb.exec(f"touch /usr/x /etc/x /x {home_file} {tmp_path}/escape; echo $?")
            reads = await sb.exec(f"cat {run_dir}/secret.txt; ls {tmp_path}")
            with pytest.raises(SandboxError):
                await sb.read_file("../../runs/r1/secret.txt")
            await sb.exec(f"ln -s {run_dir}/secret.txt link")
            with pytest.raises(SandboxError):
                await sb.read_file("link")
            with pytest.raises(SandboxError):
                await sb.write_file("/etc/passwd", "x")
            return writes, reads

    writes, reads = run(episode())
    assert writes.stdout.strip() != "0" and writes.stderr.count("Read-only file system") >= 3
    assert not (tmp_path / "escape").exists() and not home_file.exists()
    assert "do not read" not in reads.stdout and "No such file" in reads.stderr


def test_unsearchable_root_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("the sandbox runs as ourselves when we are not root")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(SandboxStartError, match="root_not_searchable"):
        run(BwrapSandbox(BwrapSettings(root=str(private / "sb"))).create())


def test_sandbox_root_inside_the_run_directory_is_refused(tmp_path):
    s = BwrapSettings(root=str(tmp_path / "run" / "sb"), forbidden=(str(tmp_path / "run"),))
    with pytest.raises(SandboxStartError, match="root_in_run_dir"):
        run(BwrapSandbox(s).create())


def test_killed_at_memory_limit(tmp_path):
    async def episode():
        async with BwrapSandbox(settings(tmp_path, mem_mb=128)) as sb:
            big = await sb.exec(["python3", "-c", "x = bytearray(512 << 20); print('allocated')"])
            small = await sb.exec(["python3", "-c", "x = bytearray(16 << 20); print('allocated')"])
            return big, small

    big, small = run(episode())
    assert big.returncode != 0 and big.killed_reason == "memory" and "allocated" not in big.stdout
    assert small.ok and "allocated" in small.stdout


def test_killed_at_cpu_and_wall_time_limits(tmp_path):
    async def episode():
        async with BwrapSandbox(settings(tmp_path, cpu_s=1)) as sb:
            spin = await sb.exec(["python3", "-c", "while True: pass"], timeout_s=60)
            sleep = await sb.exec("sleep 60 & sleep 60; echo done", timeout_s=0.5)
            after = await sb.exec("echo alive")
            return spin, sleep, after

    spin, sleep, after = run(episode())
    assert spin.killed_reason == "cpu_time" and not spin.timed_out
    assert sleep.timed_out and sleep.killed_reason == "wall_time" and "done" not in sleep.stdout
    assert after.ok and after.stdout == "alive\n"


def test_process_limit(tmp_path):
    async def episode():
        async with BwrapSandbox(settings(tmp_path, nproc=8)) as sb:
            return await sb.exec("for i in $(seq 20); do sleep 2 & done; wait; echo finished", timeout_s=20)

    r = run(episode())
    assert "Cannot fork" in r.stderr or "fork" in r.stderr.lower()


def test_nothing_left_after_close_even_after_an_exception(tmp_path):
    marker = f"{os.getpid()}{id(tmp_path)}"
    holder: list[BwrapSandbox] = []

    async def episode():
        async with BwrapSandbox(settings(tmp_path)) as sb:
            holder.append(sb)
            await sb.write_file("data.bin", os.urandom(1024))
            asyncio.ensure_future(sb.exec(f"sleep {marker}"))
            for _ in range(500):  # wait until the command runs (a busy host may take seconds)
                if pids_running(marker):
                    break
                await asyncio.sleep(0.02)
            assert pids_running(marker)
            raise RuntimeError("the episode crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        run(episode())
    sb = holder[0]
    assert sb.closed and not sb.path.exists()
    assert list((tmp_path / "sandboxes").iterdir()) == []
    assert pids_running(marker) == []
    with pytest.raises(SandboxError, match="closed"):
        run(sb.exec("true"))


def test_a_dropped_sandbox_is_wiped_by_its_finalizer(tmp_path):
    async def make():
        sb = BwrapSandbox(settings(tmp_path))
        await sb.create()
        await sb.write_file("f", "x")
        return sb.path

    path = run(make())
    gc.collect()
    assert not path.exists()


def test_command_line_is_isolated_by_construction(tmp_path):
    argv = bwrap_argv(BwrapSettings(), "/tmp/x", ["true"])
    for flag in ("--unshare-net", "--unshare-pid", "--unshare-user", "--die-with-parent", "--clearenv"):
        assert flag in argv
    binds = [argv[i + 1 : i + 3] for i, a in enumerate(argv) if a == "--bind"]
    assert binds == [["/tmp/x", "/sandbox"]]


class Counting:
    """Real bwrap sandboxes, counting how many exist at once."""

    def __init__(self, tmp_path: Path, fail_first: int = 0) -> None:
        self.tmp_path, self.fail_first = tmp_path, fail_first
        self.live = self.peak = self.made = 0

    def __call__(self) -> BwrapSandbox:
        outer = self
        self.made += 1
        fail = self.made <= self.fail_first

        class Tracked(BwrapSandbox):
            async def create(self) -> None:
                if fail:
                    raise SandboxStartError("boom", "injected start failure")
                await super().create()
                outer.live += 1
                outer.peak = max(outer.peak, outer.live)

            async def close(self) -> None:
                if self.path is not None and not self.closed:
                    outer.live -= 1
                await super().close()

        return Tracked(settings(self.tmp_path))


def test_pool_bounds_concurrency_and_starts_ahead(tmp_path):
    factory = Counting(tmp_path)

    async def main():
        pool = await SandboxPool(factory, max_live=2, start_ahead=2).start()
        for _ in range(200):  # the two ahead-starts finish in the background
            if len(pool._ready) == 2:
                break
            await asyncio.sleep(0.02)
        made_before = factory.made

        async def episode(i: int) -> str:
            async with pool.acquire() as sb:
                return (await sb.exec(f"echo {i}")).stdout.strip()

        outs = await asyncio.gather(*(episode(i) for i in range(6)))
        await pool.close()
        return made_before, outs, pool.stats()

    made_before, outs, stats = run(main())
    assert made_before == 2 and outs == [str(i) for i in range(6)]
    assert factory.peak <= 2 and factory.live == 0 and stats["handed_out"] == 6
    assert list((tmp_path / "sandboxes").iterdir()) == []


def test_pool_retries_then_drops_with_a_counted_reason(tmp_path):
    async def main(fail_first: int):
        pool = SandboxPool(Counting(tmp_path, fail_first), max_live=1, retries=2, retry_delay_s=0)
        try:
            async with pool.acquire() as sb:
                out = (await sb.exec("echo up")).stdout.strip()
        except SandboxStartError as e:
            out = e.reason
        async with pool.acquire() as sb:  # the slot of a dropped start came back
            await sb.exec("true")
        return out, pool.stats()

    out, stats = run(main(fail_first=2))
    assert out == "up" and stats["failures"] == {"boom": 2} and stats["dropped"] == {}
    out, stats = run(main(fail_first=3))
    assert out == "boom" and stats["failures"] == {"boom": 3} and stats["dropped"] == {"boom": 1}


def test_sandboxes_die_with_a_killed_owner(tmp_path):
    marker = f"77{os.getpid()}{id(tmp_path) % 10**6}"
    code = (
        "import asyncio\n"
        "from miles.agentic.sandbox.bwrap import BwrapSandbox, BwrapSettings\n"
        "async def main():\n"
        f"    sb = BwrapSandbox(BwrapSettings(root={str(tmp_path / 'sandboxes')!r}))\n"
        "    await sb.create()\n"
        "    print('created', flush=True)\n"
        f"    await sb.exec('sleep {marker}')\n"
        "asyncio.run(main())\n"
    )
    assert left_after_owner_killed(code, marker) == []
    # its episode directory outlived it (nothing was left to wipe it); the next sandbox made under
    # that root, here by this process, removes it
    root = tmp_path / "sandboxes"
    [orphan] = list(root.iterdir())

    async def next_one() -> None:
        async with BwrapSandbox(settings(tmp_path)) as sb:
            assert sb.path is not None and sb.path.name.startswith(owner_prefix() + "-")

    run(next_one())
    assert not orphan.exists() and list(root.iterdir()) == []


def test_the_sweep_spares_live_owners_and_other_namespaces(tmp_path):
    live = tmp_path / f"{owner_prefix(os.getppid())}-abc"  # the parent of this test process is alive
    other_ns = tmp_path / "sb-1-999999999-abc"
    gone = tmp_path / f"{owner_prefix(999999999)}-abc"  # above the kernel's pid_max
    foreign = tmp_path / "notes"
    for d in (live, other_ns, gone, foreign):
        (d / "app").mkdir(parents=True)
    assert sweep_orphans(tmp_path) == [gone.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, other_ns, foreign))
    (tmp_path / f"{owner_prefix(999999999)}-def").mkdir()
    assert sweep_orphans(tmp_path) == []  # once per root and process
