"""One layer's decode attention on one GPU: the Triton paged kernel vs the decoder's gather + SDPA path.

    python -m bench.decode_attention_gpu [--batch 64 256] [--context 128 384 640] [--out FILE]

Shapes: Qwen2.5-0.5B heads (14 q heads, 2 kv heads, head_dim 64), bf16. The pool holds
batch * context + 1 slots; each request's context is a random set of them; positions are uniform in
the last 128 positions of the context (the engine pads contexts to multiples of 128). Times (ms,
median) for one layer:
- `gather+sdpa`: what the decoder runs today: the K and V gathers into [KVH*B, 1, L, D] copies
  (`_gather_slots`) and one SDPA call over the folded queries, the mask built beforehand (the
  decoder builds it once per forward, not per layer);
- `gather`: the two gathers alone;
- `kernel`: `paged_decode_attention` with its default split count (shown as S);
each with `triton.testing.do_bench` (CUDA events, L2 flushed between runs) and, as the engine runs a
decode step, replayed in a CUDA graph (`do_bench_cudagraph`, L2 not flushed). `x24` is the saving
per decode step over 24 layers. A sweep of split count x key block at batch 256 follows. Every shape
first checks the kernel against the reference (max |diff| in bf16).
"""

from __future__ import annotations

import argparse
import json

import torch

from miles.models.tiny import QWEN25_05B_SHAPE

H = QWEN25_05B_SHAPE["num_attention_heads"]
KVH = QWEN25_05B_SHAPE["num_key_value_heads"]
D = QWEN25_05B_SHAPE["hidden_size"] // H
LAYERS = QWEN25_05B_SHAPE["num_hidden_layers"]
DTYPE = torch.bfloat16


def problem(batch: int, context: int, seed: int = 0):
    """q, k_pool, v_pool, context_slots, positions on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = batch * context + 1
    q = torch.randn(batch, H, D, device="cuda", generator=gen).to(DTYPE)
    k = torch.randn(KVH, total, D, device="cuda", generator=gen).to(DTYPE)
    v = torch.randn(KVH, total, D, device="cuda", generator=gen).to(DTYPE)
    slots = (
        torch.randperm(total - 1, device="cuda", generator=gen)[: batch * context].view(batch, context) + 1
    )
    low = max(0, context - 128)
    positions = torch.randint(low, context, (batch,), device="cuda", generator=gen)
    return q, k, v, slots, positions


def gather_sdpa(q, k, v, slots, positions):
    """The decoder's decode attention today (Decoder._attention, Q = 1), with its mask prebuilt."""
    import torch.nn.functional as F

    from miles.engine.model import _gather_slots

    B, L = slots.shape
    G = H // KVH
    seen = torch.arange(L, device="cuda")[None, :] <= positions[:, None]
    seen = seen[None, :, None, :].expand(KVH, B, G, L).reshape(KVH * B, 1, G, L)
    mask = torch.zeros(seen.shape, dtype=DTYPE, device="cuda").masked_fill_(~seen, float("-inf"))

    def run():
        kb = _gather_slots(k, slots).view(KVH * B, 1, L, D)
        vb = _gather_slots(v, slots).view(KVH * B, 1, L, D)
        qb = q.view(B, KVH, G, D).transpose(0, 1).reshape(KVH * B, 1, G, D)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)
        return out.view(KVH, B, G, D).transpose(0, 1).reshape(B, H, D)

    def gather_only():
        return _gather_slots(k, slots), _gather_slots(v, slots)

    return run, gather_only


def timings(fn) -> tuple[float, float]:
    """(do_bench median, CUDA-graph median) in ms."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    return do_bench(fn, warmup=10, rep=50, return_mode="median"), do_bench_cudagraph(
        fn, rep=50, return_mode="median"
    )


def compare(batch: int, context: int) -> dict:
    from miles.engine.triton_attention import default_splits, paged_decode_attention

    q, k, v, slots, positions = problem(batch, context)
    run_ref, run_gather = gather_sdpa(q, k, v, slots, positions)
    kernel = lambda: paged_decode_attention(q, k, v, slots, positions, D**-0.5)  # noqa: E731
    err = (kernel().float() - run_ref().float()).abs().max().item()
    row = dict(batch=batch, context=context, splits=default_splits(batch, KVH, context, 64, q.device))
    row["max_abs_diff"] = err
    for name, fn in (("gather+sdpa", run_ref), ("gather", run_gather), ("kernel", kernel)):
        row[name], row[name + " (graph)"] = timings(fn)
    return row


def sweep(batch: int, context: int) -> list[dict]:
    from miles.engine.triton_attention import paged_decode_attention

    q, k, v, slots, positions = problem(batch, context)
    rows = []
    for block_n in (32, 64, 128):
        for splits in (1, 2, 4, 8):
            fn = lambda s=splits, n=block_n: paged_decode_attention(  # noqa: E731
                q, k, v, slots, positions, D**-0.5, num_splits=s, block_n=n
            )
            ms, graph_ms = timings(fn)
            rows.append(
                dict(batch=batch, context=context, block_n=block_n, splits=splits, ms=ms, graph_ms=graph_ms)
            )
    return rows


def print_row(r: dict) -> None:
    def pair(name: str) -> str:
        return f"{r[name]:.4f} / {r[name + ' (graph)']:.4f}"

    saved = LAYERS * (r["gather+sdpa (graph)"] - r["kernel (graph)"])
    print(
        f"{r['batch']:>4} {r['context']:>4} {r['splits']:>2} {pair('gather+sdpa'):>18} {pair('gather'):>16} "
        f"{pair('kernel'):>16} {saved:>8.3f}ms {r['max_abs_diff']:>8.1e}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, nargs="+", default=[128, 384, 640])
    p.add_argument("--out", help="also write the rows as JSON here")
    args = p.parse_args()
    import triton

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"heads {H}/{KVH}, head_dim {D}, {DTYPE}; ms per layer, median; (graph) = replayed in a CUDA graph")
    head = f"{'B':>4} {'L':>4} {'S':>2} {'gather+sdpa':>18} {'gather':>16} {'kernel':>16} {'x24 saved':>10} {'diff':>8}"
    print(head)
    rows = []
    for batch in args.batch:
        for context in args.context:
            r = compare(batch, context)
            rows.append(r)
            print_row(r)
    print("\nsweep at batch 256 (kernel ms / graph ms):")
    swept = [row for context in args.context for row in sweep(256, context)]
    for row in swept:
        print(f"  L {row['context']:>4} block_n {row['block_n']:>3} splits {row['splits']}: "
              f"{row['ms']:.4f} / {row['graph_ms']:.4f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"compare": rows, "sweep": swept}, f, indent=1)


if __name__ == "__main__":
    main()
