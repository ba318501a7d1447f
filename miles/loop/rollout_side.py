"""Everything trainer rank 0 does besides training: rollout, weight pushes, evaluation.

It owns one background thread running an asyncio loop; generation (the producer), weight pushes
(the transport) and evaluation all run there, so HTTP work overlaps the trainer's compute. The
trainer thread talks to it through a few blocking calls. Engines are found in the run directory:
RUN_DIR/rendezvous/engines/*.json (each `{"url": ...}`) and, when present, RUN_DIR/rendezvous/
router.json, which then receives all generation traffic (admin calls always go to each engine).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from miles.config import Plan
from miles.quant.formats import engine_contract
from miles.rollout.buffer import RolloutBuffer, load_policy
from miles.rollout.client import SGLangClient
from miles.rollout.generate import SPECULATIVE, Generator, PromptEncoder
from miles.rollout.producer import Producer
from miles.rollout.rewards import load_reward
from miles.rollout.tasks import plan_task
from miles.rollout.teacher import Teacher, check_tokenizer
from miles.sample import Sample, Status
from miles.serving import run_keys

if TYPE_CHECKING:
    from miles.eval.datasets import EvalSuite
    from miles.weights import Bucket, WeightTransport

log = logging.getLogger("miles.loop")


def engine_urls(run_dir: Path, timeout_s: float = 60.0) -> tuple[list[str], str | None]:
    """(engine URLs, router URL or None) of this incarnation, from the run directory's rendezvous."""
    from miles.cluster.environment import JobEnvironment
    from miles.cluster.rendezvous import engines_dir, read_engines, read_router

    incarnation = JobEnvironment.from_env().incarnation
    deadline = time.monotonic() + timeout_s
    while not (records := read_engines(run_dir, incarnation)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not records:
        raise RuntimeError(
            f"no engine of incarnation {incarnation!r} published in {engines_dir(run_dir)} within "
            f"{timeout_s:.0f}s (engine.startup_timeout_s); see {run_dir / 'logs'}"
        )
    return [r["url"] for r in records], read_router(run_dir, incarnation)


def teacher_urls(run_dir: Path, timeout_s: float) -> list[str]:
    """URLs of the teacher engines started for train.distill.teacher_model (their rendezvous records)."""
    from miles.cluster.environment import JobEnvironment
    from miles.cluster.rendezvous import TEACHERS, engines_dir, read_engines

    incarnation = JobEnvironment.from_env().incarnation
    deadline = time.monotonic() + timeout_s
    while not (records := read_engines(run_dir, incarnation, TEACHERS)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not records:
        raise RuntimeError(
            f"no teacher engine published in {engines_dir(run_dir, TEACHERS)} within {timeout_s:.0f}s; "
            f"see {run_dir / 'logs'}"
        )
    return [r["url"] for r in records]


def batch_metrics(samples: list[Sample]) -> dict[str, float]:
    """Reward, length, truncation and version facts of the samples of one training batch."""
    n = max(len(samples), 1)
    versions = [len(set(s.weight_versions)) for s in samples]
    return {
        "rollout/reward_mean": sum(s.reward for s in samples) / n,
        "rollout/response_len_mean": sum(s.response_length for s in samples) / n,
        "rollout/response_len_max": float(max((s.response_length for s in samples), default=0)),
        "rollout/truncated_frac": sum(s.status is Status.TRUNCATED for s in samples) / n,
        "rollout/multi_version_frac": sum(v > 1 for v in versions) / n,
        "rollout/resent_frac": sum(s.metadata.get("attempts", 1) > 1 for s in samples) / n,
        "rollout/batch_samples": float(len(samples)),
        **speculative_metrics(samples),
    }


def speculative_metrics(samples: list[Sample]) -> dict[str, float]:
    """With speculative rollout: the share of proposed draft tokens the target kept
    (`rollout/spec_accept_rate`) and the tokens each verify forward gave (`rollout/spec_accept_length`,
    kept proposals + 1 per forward, SGLang's accept length); nothing otherwise."""
    verify, drafted, kept = (sum(s.metadata.get(k, 0) for s in samples) for k in SPECULATIVE)
    if not verify:
        return {}
    return {
        "rollout/spec_accept_rate": kept / drafted if drafted else 0.0,
        "rollout/spec_accept_length": (kept + verify) / verify,
    }


REPLACED = "engines-replaced"
"""What `RolloutSide.batch` returns after replacing a lost engine: push the weights, then ask again."""

_SETUP_TIMEOUT_S = 600.0


class RolloutSide:
    """Rank 0's rollout machinery behind a small blocking API for the training loop."""

    def __init__(self, plan: Plan, run_dir: Path) -> None:
        from miles.cluster.environment import JobEnvironment

        self.plan, self.run_dir = plan, run_dir
        self.incarnation = JobEnvironment.from_env().incarnation
        urls, router = engine_urls(run_dir, plan.engine.startup_timeout_s)
        r = plan.rollout
        self.task = plan_task(plan)
        encoder = PromptEncoder(plan.model.path)
        self.generator = Generator.from_config([], encoder, load_reward(r.reward), r)
        self.generator.on_unreachable = self._on_unreachable
        self.generator.routed_experts = plan.train.routing_replay == "rollout"
        self._connect(urls, router)
        self.buffer = RolloutBuffer(
            r.buffer_capacity_groups or 2 * r.prompts_per_step, load_policy(r.buffer_policy), r.max_staleness
        )
        self.producer = Producer(
            self.generator,
            self.task,
            self.buffer,
            r.n_samples_per_prompt,
            r.max_concurrency_per_engine * len(urls),
            group_requests=r.group_requests,
            teacher=self._teacher(encoder),
            max_masked_groups=r.max_masked_groups,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout", daemon=True)
        self._stop: asyncio.Event | None = None
        self._forever: Future[None] | None = None
        self._fill: Future[None] | None = None
        self.lost: set[str] = set()
        """URLs of engines found unreachable since the last (re)connection."""
        self.published = set(urls)
        """The engine URLs published when we last connected (a change means a replacement)."""
        self._closing = False
        self.replacements = 0
        """Reconnections after a lost engine so far (metric `engine/replacements`)."""
        self.eval_suites: list[EvalSuite] = []
        """The evaluation datasets (built at the first evaluation)."""
        self.eval_skipped: Counter[str] = Counter()
        """Evaluations skipped so far, by reason (metrics `eval/skipped_<reason>`)."""

    def _teacher(self, encoder: PromptEncoder) -> Teacher | None:
        """The distillation teacher of train.distill (its servers: teacher_urls, or the engine
        published for teacher_model), its tokenizer checked against the student's; None: off."""
        d = self.plan.train.distill
        if d is None:
            return None
        urls = d.teacher_urls or teacher_urls(self.run_dir, self.plan.engine.startup_timeout_s)
        keys = run_keys(self.run_dir) if not d.teacher_urls else None
        clients = [
            SGLangClient(u, max_connections=self.plan.rollout.max_concurrency_per_engine + 8, keys=keys)
            for u in urls
        ]

        async def check() -> None:  # on a loop of its own: close its connections before it ends
            for c in clients:
                try:
                    await check_tokenizer(
                        c, lambda text: encoder.tokenizer.encode(text, add_special_tokens=False)
                    )
                finally:
                    await c.aclose()

        asyncio.run(check())
        return Teacher(clients, d.teacher_key, d.top_k if d.mode == "topk_reverse_kl" else 0)

    def _connect(self, urls: list[str], router: str | None) -> None:
        """Clients and weight transport for these engines (the transport joins in `_setup`)."""
        conns = self.plan.rollout.max_concurrency_per_engine * len(urls) + 8  # ours, plus admin calls
        self.urls, self.router = list(urls), router
        keys = run_keys(self.run_dir)
        self.admins = [SGLangClient(u, max_connections=conns, keys=keys) for u in urls]
        self.generator.set_clients(
            [SGLangClient(router, max_connections=conns, keys=keys)] if router else self.admins
        )
        lora = self.plan.train.lora
        if lora is not None:  # every generation runs the policy's adapter, once pushed
            if not lora.adapters:  # (several adapters: each prompt names its own)
                for client in [*self.admins, *self.generator.clients]:
                    client.lora_path = lora.name
            self.generator.ready.clear()
        self.transport = self._transport(urls)

    def _setup(self) -> None:
        """Join the weight-update group; bounded, so an engine that never answers fails the rank."""
        self.call(self.transport.setup(), timeout_s=_SETUP_TIMEOUT_S)

    def _on_unreachable(self, url: str) -> None:
        """A request found `url` gone: hold new requests until the engines are repaired."""
        if self._closing:
            return
        if url not in self.lost:
            log.warning("engine %s unreachable; holding generation until it is replaced", url)
        self.lost.add(url)
        self.generator.ready.clear()

    def _transport(self, urls: list[str]) -> WeightTransport:
        """The run's weight transport (`weights.transport`, derived `lora` for LoRA runs)."""
        from miles.weights import Site, get_transport

        local = all(urlparse(u).hostname in ("127.0.0.1", "localhost") for u in urls)
        address = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
        site = Site(self.admins, self.run_dir, local, address)
        return get_transport(self.plan.weights.transport).from_plan(self.plan, site)

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Run a coroutine on the rollout loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self, next_index: int) -> None:
        """Start the loop thread, join the weight-update group, start async production."""
        self.producer.next_index = next_index
        self._thread.start()
        self._setup()
        if self.plan.rollout.schedule == "async":
            self._stop = self.call(_make_event())
            self._forever = asyncio.run_coroutine_threadsafe(
                self.producer.run_forever(self._stop), self._loop
            )

    def batch(self, current_version: int) -> list[Sample] | str:
        """The next training batch (prompts_per_step groups), flattened; or REPLACED when an engine
        was lost and has been replaced: the caller pushes the current weights and asks again."""
        n = self.plan.rollout.prompts_per_step
        while True:
            if self.lost or self._engines_changed():
                self.repair()
                return REPLACED
            if self.producer.error is not None:
                e = self.producer.error
                raise RuntimeError(f"rollout failed: {type(e).__name__}: {e}") from e
            if self.plan.rollout.schedule == "sync":
                if self._fill is None:
                    self._fill = asyncio.run_coroutine_threadsafe(self.producer.fill(n), self._loop)
                try:
                    self._fill.result(timeout=1.0)
                except TimeoutError:
                    continue
                self._fill = None
            try:
                groups = self.buffer.get(n, current_version, timeout_s=1.0)
                break
            except TimeoutError:
                if self._forever is not None and self._forever.done():
                    self._forever.result()
        return [s for g in groups for s in g]

    def _engines_changed(self) -> bool:
        """True when this incarnation's published engines are no longer the ones we talk to (one was
        replaced behind our back, or a lost one came back after we continued without it)."""
        from miles.cluster.rendezvous import read_engines

        return {r["url"] for r in read_engines(self.run_dir, self.incarnation)} != self.published

    def repair(self) -> None:
        """Reconnect to this incarnation's engines after a loss; the generator's gate stays closed
        until the caller has pushed the current weights (`push` opens it).

        Waits until every published engine answers /health; with several engines, after one health
        interval it continues with those that do (a replaced engine rejoins when it is published).
        Raises RuntimeError when none is usable within engine.startup_timeout_s.
        """
        from miles.cluster.rendezvous import healthy, read_engines, read_router

        e = self.plan.engine
        self.generator.ready.clear()
        log.warning("engines lost: %s; waiting for replacements", ", ".join(sorted(self.lost)) or "-")
        start, deadline = time.monotonic(), time.monotonic() + e.startup_timeout_s
        while True:
            urls = [r["url"] for r in read_engines(self.run_dir, self.incarnation)]
            usable = [u for u in urls if healthy(u)]
            waited = time.monotonic() - start
            if usable and (len(usable) == len(urls) or waited > e.health_check_interval_s):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engines {sorted(self.lost)} unreachable and not replaced within "
                    f"engine.startup_timeout_s={e.startup_timeout_s:.0f}s; see {self.run_dir / 'logs'}"
                )
            time.sleep(0.5)
        self._close_engine_side(timeout_s=30)
        self._connect(usable, read_router(self.run_dir, self.incarnation))
        self.published = set(urls)
        self._setup()
        self.lost.clear()
        self.replacements += 1
        log.warning("reconnected to %d engine(s): %s", len(usable), ", ".join(usable))

    def _close_engine_side(self, timeout_s: float) -> None:
        """Leave the weight-update group and close the engine clients (errors of dead engines ignored)."""
        try:
            self.call(self.transport.close(), timeout_s=timeout_s)
        except Exception as exc:
            log.warning("closing the weight transport: %s", exc)
        clients = {id(c): c for c in [*self.admins, *self.generator.clients]}.values()
        try:
            self.call(_gather(*(c.aclose() for c in clients)), timeout_s=10)
        except Exception as exc:
            log.warning("closing engine clients: %s", exc)

    def release_engines(self) -> None:
        """Colocated runs: every engine frees its GPU memory for the trainer (requests in flight wait)."""
        self.call(_gather(*(a.release_memory_occupation() for a in self.admins)))

    def resume_engines(self) -> None:
        self.call(_gather(*(a.resume_memory_occupation() for a in self.admins)))

    def push(self, buckets: Iterable[Bucket], version: int) -> None:
        """Push one version into every engine and open the generator's gate. When an engine is lost
        on the way, the remaining buckets are still drawn (every rank exports them collectively), the
        engine is recorded in `lost`, and the caller repairs and pushes again."""
        it = iter(buckets)
        try:
            self.call(self.transport.push(it, str(version)))
        except Exception as exc:
            dead = [a.url for a in self.admins if not self.call(a.health(), timeout_s=30)]
            if not dead:
                raise
            log.warning("weight push of version %d failed (%s); engines down: %s", version, exc, dead)
            self.lost.update(dead)
            for _ in it:
                pass
            return
        self._loop.call_soon_threadsafe(self.generator.ready.set)

    def check_metrics(self, buckets: Iterable[Bucket]) -> dict[str, float]:
        """The post-push check as a metric: `weights/check_max_diff` (bf16 engines, by values) or
        `weights/checksum_mismatch` (quantised engines and LoRA adapters, stored by the engines as
        `<adapter>/<name>`: tensors whose bytes differ, by checksums)."""
        from miles.weights import check_checksums, check_weights

        if self.plan.train.lora is None and engine_contract(self.plan) is None:
            worst = 0.0
            for bucket in buckets:
                bad = self.call(check_weights(self.admins, bucket))
                worst = max([worst, *bad.values()])
            return {"weights/check_max_diff": worst}
        mismatched = 0
        for bucket in buckets:
            bad = self.call(check_checksums(self.admins, bucket))
            for where, what in bad.items():
                log.error("weight check: %s differs after the push: %s", where, what)
            mismatched += len(bad)
        return {"weights/checksum_mismatch": float(mismatched)}

    def evaluate(self, step: int) -> dict[str, float]:
        """`shared` mode: evaluate on the rollout engines, which serve the weights of `step`. The fully
        async producer submits nothing meanwhile (requests already in flight finish). A failure is
        logged and counted (eval/skipped_error, eval/skipped_timeout), never raised."""
        from miles.eval.datasets import build_suites
        from miles.eval.modes import CountingGenerator, evaluate_step

        paused = self._pause_producer()
        gen = CountingGenerator.like(self.generator, on_unreachable=self._on_unreachable)
        try:
            self.eval_suites = self.eval_suites or build_suites(self.plan, self.task)
            work = evaluate_step(gen, self.eval_suites, step, self.run_dir / "eval")
            fut = asyncio.run_coroutine_threadsafe(work, self._loop)
            try:
                metrics = fut.result(self.plan.eval.timeout_s)
            finally:
                fut.cancel()  # no-op once done; stops an evaluation that ran out of time
            metrics.update({"eval/lag_steps": 0.0, "eval/export_s": 0.0})
        except Exception as exc:
            reason = "timeout" if isinstance(exc, TimeoutError) else "error"
            log.warning("evaluation of step %d skipped (%s): %s", step, reason, exc)
            self.eval_skipped[reason] += 1
            metrics = {f"eval/skipped_{reason}": float(self.eval_skipped[reason])}
        finally:
            if paused:
                self._resume_producer()
        return metrics

    def _pause_producer(self) -> bool:
        """Stop the fully async producer from submitting (True when it was running)."""
        if self._forever is None or self._stop is None:
            return False
        self._loop.call_soon_threadsafe(self._stop.set)
        self._forever.result(timeout=self.plan.engine.startup_timeout_s)
        return True

    def _resume_producer(self) -> None:
        self._stop = self.call(_make_event())
        self._forever = asyncio.run_coroutine_threadsafe(self.producer.run_forever(self._stop), self._loop)

    def metrics(self) -> dict[str, float]:
        """Buffer, producer and per-engine counters (engine i: `engine/<i>/num_steps`, ...)."""
        out = {**self.buffer.metrics(), **self.producer.stats.take()}
        if self.producer.teacher is not None:  # summed over groups scored concurrently with rollout
            out["time/teacher_s"] = self.producer.teacher.take_busy_s()
        out["engine/replacements"] = float(self.replacements)  # reconnections after a lost engine, so far
        try:
            infos = self.call(_gather(*(a.get_server_info() for a in self.admins)), timeout_s=10)
        except Exception as e:
            log.warning("engine stats unavailable: %s", e)
            return out
        for i, info in enumerate(infos):
            state = (info.get("internal_states") or [{}])[0]
            for key in ("num_steps", "num_running_reqs", "num_waiting_reqs"):
                if isinstance(state.get(key), (int, float)):
                    out[f"engine/{i}/{key}"] = float(state[key])
        return out

    def stop(self) -> None:
        self._closing = True
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.generator.ready.set)
            try:
                self.call(self.producer.drain(), timeout_s=30)
            except Exception as e:
                log.warning("rollout shutdown: %s", e)
            self._close_engine_side(timeout_s=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


async def _gather(*coros: Coroutine[Any, Any, Any]) -> list[Any]:
    return list(await asyncio.gather(*coros))


async def _make_event() -> asyncio.Event:
    return asyncio.Event()
