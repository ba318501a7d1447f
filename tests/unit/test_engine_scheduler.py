"""The engine core in-process: log-probs vs HF, batching invariance, prefix reuse, pause + update."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from miles.engine.model import Decoder, ModelSpec, load_weights
from miles.engine.request import prefill_groups
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Request, Scheduler


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(params=[False, True], ids=["in_step", "overlap"])
def engine(tiny_model, request):
    """The engine thread, recording each step's tokens at once or (overlap, as on CUDA) one step late."""
    spec = ModelSpec.from_dir(tiny_model)
    decoder = Decoder(spec, load_weights(tiny_model), "cpu", torch.float32)
    sched = Scheduler(decoder, 64, 8192, overlap=request.param)
    thread = threading.Thread(target=sched.run, daemon=True)
    thread.start()
    yield sched
    sched.stop()
    thread.join(timeout=10)


def _req(rid, prompt, max_new, temperature=0.0, seed=0, **kw) -> Request:
    sp = SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True, **kw)
    return Request(rid=str(rid), prompt=list(prompt), params=sp, seed=seed, stop_ids=frozenset())


def _run(sched: Scheduler, reqs: list[Request]) -> list[Request]:
    for r in reqs:
        sched.submit(r)
    return [r.done.result(timeout=60) for r in reqs]


def _mixed(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(4, 380) for _ in range(rng.randint(1, 60))], rng.randint(1, 40)) for _ in range(n)
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_logprobs_match_hf_full_forward(engine, hf_model, temperature):
    """Log-probs are of softmax(z / T) (raw z for greedy), the distribution the trainer recomputes."""
    reqs = _run(engine, [_req(i, p, m, temperature, seed=i) for i, (p, m) in enumerate(_mixed(12, 1))])
    worst = 0.0
    for r in reqs:
        ids = torch.tensor([r.prompt + r.output])
        with torch.no_grad():
            logp = (hf_model(ids).logits[0].float() / (temperature or 1.0)).log_softmax(-1)
        n = len(r.prompt)
        ref = torch.stack([logp[n - 1 + j, t] for j, t in enumerate(r.output)])
        worst = max(worst, (ref - torch.tensor(r.logprobs)).abs().max().item())
        if temperature == 0:
            assert r.output == logp[n - 1 : -1].argmax(-1).tolist()
    assert worst <= 1e-4


@pytest.mark.slow
def test_batched_equals_one_at_a_time(engine):
    work = _mixed(64, 2)
    together = _run(engine, [_req(i, p, m) for i, (p, m) in enumerate(work)])
    engine.slots.flush()
    alone = [_run(engine, [_req(i, p, m)])[0] for i, (p, m) in enumerate(work)]
    assert [r.output for r in together] == [r.output for r in alone]
    assert all(len(r.output) == m for r, (_, m) in zip(together, work, strict=True))


def test_seeded_sampling_reproducible_and_seed_dependent(engine):
    prompt = list(range(5, 25))
    a, b, c = _run(
        engine,
        [
            _req("a", prompt, 30, 1.0, seed=7),
            _req("b", prompt, 30, 1.0, seed=7),
            _req("c", prompt, 30, 1.0, seed=8),
        ],
    )
    assert a.output == b.output
    assert a.output != c.output


def test_top_k_one_is_greedy(engine):
    prompt = list(range(30, 50))
    greedy, topk = _run(engine, [_req("g", prompt, 20), _req("k", prompt, 20, 1.0, seed=3, top_k=1)])
    assert greedy.output == topk.output


def test_prefix_reuse(engine):
    system = list(range(10, 70))
    first = _run(engine, [_req("t1", system + [5, 6], 10)])[0]
    turn2 = system + [5, 6] + first.output + [7, 8, 9]
    cached = _run(engine, [_req("t2", turn2, 10)])[0]
    assert cached.cached_tokens >= len(system) + 2
    engine.holdings.flush_cache()
    fresh = _run(engine, [_req("t3", turn2, 10)])[0]
    assert fresh.cached_tokens == 0
    assert fresh.output == cached.output


def test_pause_in_place_keeps_requests_across_update(engine, tiny_model):
    engine.pause("in_place")
    reqs = [_req(i, p, 300) for i, (p, _) in enumerate(_mixed(4, 3))]
    for r in reqs:
        engine.submit(r)
    engine.resume()
    _wait_until(lambda: all(len(r.output) >= 2 for r in reqs))
    engine.pause("in_place")
    assert not any(r.done.done() for r in reqs)
    new = {k: v * 1.5 for k, v in load_weights(tiny_model).items() if k.endswith("norm.weight")}
    engine.holdings.update_weights(new, "v1", abort_all=False)
    engine.resume()
    done = [r.done.result(timeout=60) for r in reqs]
    for r in done:
        assert r.finish["type"] == "length" and len(r.output) == 300
        assert r.versions[0] == "default" and r.versions[-1] == "v1"


def test_pause_retract_then_continue_gives_same_tokens(engine):
    prompts = [list(range(3 + i, 20 + i)) for i in range(3)]
    reference = _run(engine, [_req(f"ref{i}", p, 300) for i, p in enumerate(prompts)])
    engine.holdings.flush_cache()
    reqs = [_req(i, p, 300) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    _wait_until(lambda: all(len(r.output) >= 2 for r in reqs))
    engine.pause("retract")
    assert not engine.running and not any(r.done.done() for r in reqs)
    assert all(len(r.output) < 300 and not r.slots for r in reqs)
    engine.resume()
    done = [r.done.result(timeout=60) for r in reqs]
    assert [r.output for r in done] == [r.output for r in reference]


def test_pause_abort_finishes_everything(engine):
    reqs = [_req(i, list(range(3, 20)), 200) for i in range(3)]
    for r in reqs:
        engine.submit(r)
    _wait_until(lambda: all(len(r.output) >= 1 for r in reqs))
    engine.pause("abort")
    assert all(r.done.result(timeout=10).finish["type"] == "abort" for r in reqs)
    assert engine.slots.num_free + engine.slots.num_cached_tokens == engine.max_total_tokens
    engine.resume()
    assert _run(engine, [_req("after", [1, 2, 3], 3)])[0].finish["type"] == "length"


def test_abort_by_rid(engine):
    keep, drop = _req("keep", [1, 2, 3], 30), _req("drop", [4, 5, 6], 100000)
    engine.submit(keep)
    engine.submit(drop)
    engine.abort("drop")
    assert drop.done.result(timeout=10).finish["type"] == "abort"
    assert keep.done.result(timeout=10).finish["type"] == "length"


def _wait_until(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlap_records_the_same_tokens(tiny_model, temperature):
    """Running one decode step ahead of the readback changes nothing a request sees: same tokens,
    log-probs and finish reasons, with requests stopping on stop tokens mid-flight, more requests
    than the batch holds (admissions between overlapped steps), and finished prefixes cached."""
    spec = ModelSpec.from_dir(tiny_model)
    stop = frozenset(range(100, 120))
    work = _mixed(20, 7)
    results, ahead = [], []
    for overlap in (False, True):
        sched = Scheduler(
            Decoder(spec, load_weights(tiny_model), "cpu", torch.float32), 6, 4096, overlap=overlap
        )
        real = sched.decoding.advance
        sched.decoding.advance = lambda f=real: (ahead.append(f()), ahead[-1])[1]
        reqs = [_req(i, p, m, temperature, seed=i) for i, (p, m) in enumerate(work)]
        for r in reqs:
            r.stop_ids = stop
            sched.submit(r)
        sched.run_until_idle()
        again = _req("again", reqs[0].prompt + reqs[0].output, 5, temperature, seed=99)
        sched.submit(again)
        sched.run_until_idle()
        results.append((reqs, again))
        assert sched.decoding.inflight is None and not sched.running
        assert sched.slots.num_cached_tokens > 0
        sched.slots.flush()
        assert sched.slots.num_free == sched.max_total_tokens  # no slot leaked
    (plain, plain_again), (lagged, lagged_again) = results
    assert [r.output for r in lagged] == [r.output for r in plain]
    # the plain CPU engine decodes on RowKV rows, the overlapped one gathers: same maths, other kernels
    pairs = zip(lagged, plain, strict=True)
    assert max(abs(a - b) for r, q in pairs for a, b in zip(r.logprobs, q.logprobs, strict=True)) <= 1e-5
    assert [r.finish for r in lagged] == [r.finish for r in plain]
    assert any(r.finish["type"] == "stop" for r in plain) and any(r.finish["type"] == "length" for r in plain)
    assert lagged_again.output == plain_again.output
    assert lagged_again.cached_tokens == plain_again.cached_tokens > len(reqs[0].prompt)
    assert sum(ahead) > 20  # the overlapped engine did run ahead


def test_cpu_row_decode_agrees_with_gathering_path(tiny_model):
    """CPU decode reads each request's K/V row in place (RowKV) and takes prompts that arrive while
    others decode into the same forward; the slot-gathering path with separate prefill forwards (the
    one GPUs take) must give the same greedy tokens and log-probs. The workload leaves holes in the
    rows (requests finish at different steps) and has one request whose context outgrows the rows'
    capacity mid-decode, so steps fall back to gathering and the rows catch up from the pool after."""
    spec = ModelSpec.from_dir(tiny_model)
    work = _mixed(12, 5) + [([7 + i % 300 for i in range(250)], 30)]
    outputs, mixed = [], []
    for rows in (True, False):
        sched = Scheduler(Decoder(spec, load_weights(tiny_model), "cpu", torch.float32), 16, 4096)
        sched._alloc_memory()
        if rows:
            real = sched.decoder.forward_rows  # records whether a prefill rode along (5th argument)
            sched.decoder.forward_rows = lambda *a, f=real: (mixed.append(a[4] is not None), f(*a))[1]
        else:
            sched.row_kv = None
        thread = threading.Thread(target=sched.run, daemon=True)
        thread.start()
        try:
            reqs = [_req(i, p, m) for i, (p, m) in enumerate(work)]
            first = reqs[:4]
            for r in first:
                sched.submit(r)
            _wait_until(lambda: all(r.output for r in first))  # noqa: B023
            _run(sched, reqs[4:])
            outputs.append([r.done.result(timeout=60) for r in reqs])
        finally:
            sched.stop()
            thread.join(timeout=10)
        if rows:
            assert sched.row_kv.capacity == sched.row_kv.max_capacity < len(work[-1][0]) + work[-1][1]
            assert max(sched.row_kv.filled) > 0 and any(mixed)
    on_rows, gathered = outputs
    assert [r.output for r in on_rows] == [r.output for r in gathered]
    assert all(len(r.output) == m for r, (_, m) in zip(on_rows, work, strict=True))
    pairs = zip(on_rows, gathered, strict=True)
    worst = max(abs(a - b) for r, g in pairs for a, b in zip(r.logprobs, g.logprobs, strict=True))
    assert worst <= 1e-5


def test_admin_operations_run_on_the_engine_thread(engine, tiny_model):
    """Weight copies run on the engine thread (one thread runs every torch kernel), and an error
    raised there reaches the caller."""
    seen = []
    load = engine.decoder.load
    engine.decoder.load = lambda w, strict=False: (seen.append(threading.current_thread()), load(w, strict))
    norms = {k: v for k, v in load_weights(tiny_model).items() if k.endswith("norm.weight")}
    engine.holdings.update_weights(norms, "v2", abort_all=False)
    assert seen == [engine._engine_thread] and seen[0] is not threading.current_thread()
    assert engine.weight_version == "v2"
    with pytest.raises(ValueError, match="unknown weight names"):
        engine.holdings.update_weights({"no.such.weight": torch.zeros(1)}, "v3", abort_all=False)
    assert engine.weight_version == "v2"
    assert _run(engine, [_req("after", [1, 2, 3], 3)])[0].finish["type"] == "length"


def test_failing_step_fails_its_batch_and_the_engine_goes_on(engine):
    """The batch of a step that raises ends with a 500 abort; the KV bookkeeping starts afresh, so
    the same requests afterwards give the tokens they gave before."""
    work = _mixed(6, seed=3)
    before = _run(engine, [_req(f"a{i}", p, m) for i, (p, m) in enumerate(work)])
    engine.inject_fault("step_error")
    failed = _run(engine, [_req(f"b{i}", p, m) for i, (p, m) in enumerate(work)])
    assert all(r.finish["type"] == "abort" and r.finish["status_code"] == 500 for r in failed)
    assert "injected fault: step_error" in failed[0].finish["message"]
    assert engine.health_problem() is None and engine.num_failed_steps == 1
    after = _run(engine, [_req(f"c{i}", p, m) for i, (p, m) in enumerate(work)])
    assert [r.output for r in after] == [r.output for r in before]
    assert engine.num_failed_steps == 0 and not engine.running and engine.slots.num_free > 0


def test_failing_steps_in_a_row_end_the_thread_and_later_requests_fail_at_once(tiny_model):
    spec = ModelSpec.from_dir(tiny_model)
    sched = Scheduler(
        Decoder(spec, load_weights(tiny_model), "cpu", torch.float32), 8, 1024, max_step_failures=2
    )
    thread = threading.Thread(target=sched.run, daemon=True)
    thread.start()
    try:
        for i in range(2):
            sched.inject_fault("step_error")
            assert _run(sched, [_req(i, [1, 2, 3], 4)])[0].finish["status_code"] == 500
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert "2 engine steps failed in a row" in sched.health_problem()
        late = _req("late", [1, 2], 2)
        sched.submit(late)
        assert late.done.result(timeout=5).finish["status_code"] == 500
        assert "died" in late.finish["message"]
    finally:
        sched.stop()


def test_prefill_groups_bound_the_padding_and_keep_every_request():
    """Each group padded to its longest query and key costs at most twice its useful query x key work
    (or falls under the small-prefill floor), every request is in exactly one group, longest first."""
    rng = random.Random(0)
    for _ in range(50):
        reqs = []
        for i in range(rng.randrange(1, 60)):
            n = rng.choice([rng.randrange(1, 40), rng.randrange(1, 4000)])
            r = Request(str(i), [1] * n, SamplingParams(), i, frozenset())
            r.kv_len = rng.randrange(0, n)
            reqs.append(r)
        groups = prefill_groups(reqs)
        assert sorted(id(r) for g in groups for r in g) == sorted(id(r) for r in reqs)
        lengths = [r.num_tokens for g in groups for r in g]
        assert lengths == sorted(lengths, reverse=True)
        for g in groups:
            padded = len(g) * max(r.num_tokens - r.kv_len for r in g) * g[0].num_tokens
            useful = sum((r.num_tokens - r.kv_len) * r.num_tokens for r in g)
            assert len(g) == 1 or padded <= max(2 * useful, 1 << 22)


@pytest.mark.parametrize("ahead", [0, 1])
def test_row_constants_give_the_sampling_rows_of_a_decode_step(ahead):
    """RowConstants.decode_rows (a gather by scheduler row) equals sampling_rows (passes over the
    requests) for a decode step, a step ahead of the readback included."""
    import numpy as np

    from miles.engine.request import RowConstants, sampling_rows

    rng = random.Random(ahead)
    vocab, table = 384, RowConstants(9, 384)
    reqs = []
    for row in rng.sample(range(8), 5):
        params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                top_k=rng.choice([-1, 5]))  # fmt: skip
        req = Request(str(row), [3] * rng.randint(1, 9), params, rng.randrange(1 << 40), frozenset())
        req.output, req.row = [4] * rng.randint(0, 6), row
        table.admit(req)
        reqs.append(req)
    # the token sampled next sits after the prompt, the output and the `ahead` tokens in flight
    positions = [len(r.prompt) + len(r.output) - 1 + ahead for r in reqs]
    head = [[rng.randrange(vocab) for _ in reqs], positions, [r.row for r in reqs], list(range(len(reqs)))]
    want_ints, want_floats = sampling_rows(reqs, vocab, head, ahead=ahead)
    ints, floats = table.decode_rows(np.array(head, dtype=np.int64))
    assert torch.equal(ints, want_ints) and torch.equal(floats, want_floats)
