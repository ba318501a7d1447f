"""Session-server overhead per chat turn over a direct engine call.

    python -m bench.session_overhead [--sessions 30] [--turns 10] [--engine stub|tiny]

Each turn of a multi-turn chat is timed twice, back to back, from the same client (aiohttp, raw
JSON, so the client's own cost is the same both ways):
- through the session server: `POST /sessions/<id>/v1/chat/completions` with the whole message
  history (the server plans the prompt from its record, renders and tokenizes the appended
  messages, calls the engine's /generate, records the reply, parses it and answers OpenAI's shape);
- directly: `POST /generate` with the same prompt token ids and sampling parameters.
Overhead = session time - direct time, per turn; p50 and p99 over all turns. `overhead_cpu` is the
same difference in this process's CPU time (client and session server share the process, the
engine does not): what the server costs whatever else runs on the host.

`--engine stub` (default) answers /generate at once with a fixed 24-token reply from a separate
process, so engine time and its noise drop out; `--engine tiny` uses the real embedded engine with
the tiny model (greedy, 8 new tokens), where engine timing noise adds to the spread.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import platform
import statistics
import tempfile
import time
from pathlib import Path

REPLY = "the answer is 42 and then we add 7 to get 49 which is the total"


def _stub(queue: mp.Queue, reply_ids: list[int]) -> None:
    """An engine stand-in: /generate answers the same reply at once, SGLang's reply shape."""
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        n = len(body["input_ids"])
        rows = [[-0.5, t, None] for t in reply_ids]
        meta = {
            "id": "x",
            "finish_reason": {"type": "stop", "matched": reply_ids[-1]},
            "prompt_tokens": n,
            "completion_tokens": len(reply_ids),
            "cached_tokens": 0,
            "weight_version": "0",
            "output_token_logprobs": rows,
        }
        return web.json_response({"text": REPLY, "output_ids": reply_ids, "meta_info": meta})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        queue.put(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _measure(
    engine_url: str, model_dir: str, sessions: int, turns: int, max_new: int
) -> dict[str, list]:
    import aiohttp

    from miles.agentic.session_server import SessionServer
    from miles.rollout.client import SGLangClient

    client = SGLangClient(engine_url)
    server = SessionServer([client], model_dir, max_new_tokens=max_new)
    await server.start()
    out: dict[str, list] = {k: [] for k in ("session", "direct", "overhead", "overhead_cpu")}
    params = {"temperature": 0.0, "max_tokens": max_new}
    # what the session server sends for `params` (SessionServer._sampling)
    sampling = {
        "temperature": 0.0,
        "max_new_tokens": max_new,
        "stop_token_ids": [server.template.turn_end_id],
        "min_new_tokens": 0,
        "ignore_eos": False,
    }
    async with aiohttp.ClientSession() as http:
        for s in range(sessions + 1):  # session 0 warms up and is not counted
            sid, base = server.open_session()
            history = [{"role": "system", "content": "you are helpful, answer with numbers"}]
            for k in range(turns):
                history.append(
                    {"role": "user", "content": f"what is {k} plus {s}, then add the previous total"}
                )
                body = {"model": "m", "messages": history, "return_token_ids": True, **params}
                c0, t0 = time.process_time(), time.perf_counter()
                async with http.post(base + "/chat/completions", json=body) as r:
                    reply = await r.json()
                c1, t1 = time.process_time(), time.perf_counter()
                choice = reply["choices"][0]
                gen = {
                    "input_ids": choice["prompt_token_ids"],
                    "sampling_params": sampling,
                    "return_logprob": True,
                }
                c2, t2 = time.process_time(), time.perf_counter()
                async with http.post(engine_url + "/generate", json=gen) as r:
                    await r.read()
                c3, t3 = time.process_time(), time.perf_counter()
                history.append({"role": "assistant", "content": choice["message"]["content"]})
                if s:
                    out["session"].append((t1 - t0) * 1e3)
                    out["direct"].append((t3 - t2) * 1e3)
                    out["overhead"].append(((t1 - t0) - (t3 - t2)) * 1e3)
                    out["overhead_cpu"].append(((c1 - c0) - (c3 - c2)) * 1e3)
            server.close_session(sid)
    await server.stop()
    await client.aclose()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=30)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--engine", choices=["stub", "tiny"], default="stub")
    args = p.parse_args()

    from miles.models.tiny import build_tokenizer, init_tiny

    tmp = Path(tempfile.mkdtemp(prefix="session-bench-"))
    proc = None
    if args.engine == "stub":
        model_dir = tmp / "tok"
        tok = build_tokenizer()
        tok.save_pretrained(model_dir)
        reply_ids = tok.encode(REPLY, add_special_tokens=False)[:23] + [
            tok.convert_tokens_to_ids("<|im_end|>")
        ]
        queue: mp.Queue = mp.get_context("spawn").Queue()
        stub = mp.get_context("spawn").Process(target=_stub, args=(queue, reply_ids), daemon=True)
        stub.start()
        url, max_new = f"http://127.0.0.1:{queue.get(timeout=60)}", 24
    else:
        from miles.engine.process import start_engine

        model_dir = init_tiny(tmp / "tiny")
        proc = start_engine(model_dir, device="cpu", log_path=tmp / "engine.log")
        url, max_new = proc.url, 8
    try:
        res = asyncio.run(_measure(url, str(model_dir), args.sessions, args.turns, max_new))
    finally:
        if proc is not None:
            proc.stop()
        if args.engine == "stub":
            stub.terminate()
            stub.join(5)
    n = len(res["overhead"])
    print(f"session-server overhead per turn, engine={args.engine}, {n} turns ({platform.node()})")
    print("| path | p50 ms | p99 ms | mean ms |")
    print("| --- | --- | --- | --- |")
    for key in ("session", "direct", "overhead", "overhead_cpu"):
        xs = res[key]
        print(f"| {key} | {_pct(xs, 0.5):.2f} | {_pct(xs, 0.99):.2f} | {statistics.fmean(xs):.2f} |")


if __name__ == "__main__":
    main()
