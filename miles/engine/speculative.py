"""Speculative decoding with a separate draft model (SGLang's `--speculative-algorithm STANDALONE`).

Per decode step of the requests it takes (`Speculator.step`), for a request of N tokens whose last
token has no K/V yet (the scheduler's decode state):
1. draft: the draft model, over a KV cache of its own (one contiguous run of slots per scheduler
   row), catches up on the tokens it has not seen and proposes k tokens d1..dk one at a time, each
   sampled from its own distribution q_i = softmax(z_i / T) (greedy: its argmax);
2. verify: one target forward over [last, d1..dk] (positions N-1 .. N+k-1, k + 1 rows of a decode
   step over the request's own KV slots, replaying the decode step's CUDA graph of that many rows)
   gives the target's distributions p_1..p_{k+1};
3. accept (`accept`, standard speculative sampling): d_i is kept with probability min(1, p_i(d_i) /
   q_i(d_i)); at the first rejection a token is drawn from norm(max(0, p_i - q_i)) instead and the
   step ends; when all k are kept a bonus token is drawn from p_{k+1}. Greedy: d_i is kept while it
   is p_i's argmax, then p's argmax follows. Every token then is distributed as the target alone
   would have sampled it, and its returned log-prob is the target's, log softmax(z / T) at the token
   (T = 1 when greedy), as the plain sampler reports it;
4. the K/V of the last token and the kept drafts stay, the rejected positions' slots go back to the
   pool, so the request is again in the decode state, n + 1 tokens further on.

Requests the step does not take decode as usual: those with per-step options (log-prob rows, stop
strings, grammars, penalties), top-p / top-k sampling, or no room for a draft (max_new_tokens or
the context nearly reached, or longer than the draft cache's run per row: what an average request of
a full pool holds, at least 256 positions). The draft's weights and cache stay on the device when
the engine releases its memory for a colocated trainer. Counters per request, as SGLang's meta_info names them:
`spec_verify_ct` (verify forwards), `spec_draft_token_num` (tokens proposed),
`spec_accept_token_num` (proposed tokens kept).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

import torch

from miles.engine.request import Request, packed_batch
from miles.engine.spec import Batch
from miles.engine.spec_gate import Gate

log = logging.getLogger("miles.engine")

ALGORITHMS = ("STANDALONE", "NEXTN")
"""`--speculative-algorithm` values this engine runs: a separate draft model, or the model's own MTP
layer (miles/engine/mtp.py). SGLang's EAGLE / EAGLE3 need EAGLE heads, which it does not load."""


def accept(
    target: torch.Tensor,
    draft: torch.Tensor | None,
    proposed: list[int],
    gen: torch.Generator,
) -> tuple[list[int], int]:
    """The tokens a step appends and how many proposals were kept. `target`: [k + 1, V] the target's
    probabilities at the k proposals and after them; `draft`: [k, V] the draft's (None: greedy, then
    `target` may hold logits, only its argmax is read); `proposed`: the k draft tokens."""
    if draft is None:
        return greedy_accept(target.argmax(dim=-1).tolist(), proposed)
    for i, tok in enumerate(proposed):
        p, q = float(target[i, tok]), float(draft[i, tok])
        if q > 0 and float(torch.rand((), generator=gen)) * q < p:  # u < p / q, without dividing
            continue
        residual = (target[i] - draft[i]).clamp_min(0)
        total = float(residual.sum())
        row = residual / total if total > 0 else target[i]
        return proposed[:i] + [int(torch.multinomial(row, 1, generator=gen))], i
    return proposed + [int(torch.multinomial(target[-1], 1, generator=gen))], len(proposed)


def greedy_chain(mine: list[Request], ks: dict[int, int]) -> int:
    """k when every request of `mine` is greedy and drafts k tokens (its chain can run on the device
    with one read-back), else 0."""
    k = max(ks.values())
    return k if all(r.params.temperature <= 0 and ks[id(r)] == k for r in mine) else 0


def greedy_accept(best: list[int], proposed: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance from the target's argmax at the k proposals and after them (`best`, k + 1):
    proposals are kept while they are the target's choice, then the target's token follows."""
    n = 0
    while n < len(proposed) and proposed[n] == best[n]:
        n += 1
    return proposed[:n] + [best[n]], n


@dataclass(frozen=True)
class GreedyRows:
    """A greedy request's rows as acceptance reads them: each row's argmax and its log-prob (empty where
    not asked for)."""

    best: list[int]
    logp: list[float]


def read_rows(
    reqs: list[Request], counts: list[int], logits: torch.Tensor, logps: bool = True
) -> list[GreedyRows | torch.Tensor]:
    """Per request, its `counts` rows of `logits` [sum(counts), V] (on the engine's device) as its
    acceptance needs them on the host: a greedy request each row's argmax (and, with `logps`, its
    log-prob), computed on the device; a sampled one its rows of logits. Nothing vocabulary-wide crosses
    for greedy requests; one read-back of each kind."""
    greedy = [r.params.temperature <= 0 for r in reqs]
    starts = [sum(counts[:i]) for i in range(len(counts))]

    def rows_of(want: bool) -> torch.Tensor:
        picked = [
            s + j for s, n, g in zip(starts, counts, greedy, strict=True) if g == want for j in range(n)
        ]
        return torch.tensor(picked, dtype=torch.long, device=logits.device)

    best: list = []
    lp: list = []
    if any(greedy):
        z = logits[rows_of(True)].float()
        ids = z.argmax(dim=-1)
        if logps:
            chosen = torch.log_softmax(z, dim=-1).gather(1, ids[:, None])[:, 0]
            best, lp = torch.stack((ids.double(), chosen.double())).cpu().tolist()
        else:
            best = ids.tolist()
    host = logits[rows_of(False)].float().cpu() if not all(greedy) else None
    out: list[GreedyRows | torch.Tensor] = []
    at_g = at_s = 0
    for n, g in zip(counts, greedy, strict=True):
        if g:
            out.append(GreedyRows([int(t) for t in best[at_g : at_g + n]], lp[at_g : at_g + n]))
            at_g += n
        else:
            out.append(host[at_s : at_s + n])
            at_s += n
    return out


def propose_rows(live: list[Request], logits: torch.Tensor, i: int, drafts: dict, dists: dict) -> None:
    """Draft token i of each request of `live` from the draft's logits [len(live), V] on the device
    (`read_rows`: greedy requests' argmax as ids, the sampled ones' rows for `propose`)."""
    for r, got in zip(live, read_rows(live, [1] * len(live), logits, logps=False), strict=True):
        if isinstance(got, GreedyRows):
            drafts[id(r)].append(got.best[0])
        else:
            propose(r, got[0], i, drafts[id(r)], dists[id(r)])


class DraftCache:
    """The draft model's K/V: scheduler row r owns slots [r * stride, (r + 1) * stride); `valid[r]`
    positions of its request are computed (0 when the row changes hands)."""

    def __init__(self, decoder: Any, rows: int, stride: int, graphs: bool = False) -> None:
        self.decoder, self.stride = decoder, stride
        self.pool = decoder.new_kv_pool(rows * stride + 1)
        base = torch.arange(rows + 1)[:, None] * stride + torch.arange(stride)[None, :]
        self.table = base.clamp_max(rows * stride).to(decoder.device)
        self.valid: dict[int, tuple[int, int]] = {}
        """row -> (id of its request, positions computed)."""
        self.graphs = None
        """The draft's decode steps captured (miles/engine/cuda_graph.py) on CUDA, else None."""
        if graphs:
            from miles.engine.cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(decoder, self.pool, self.table, rows, min(rows, 64), stride)

    def computed(self, req: Request) -> int:
        owner, n = self.valid.get(req.row, (None, 0))
        return n if owner == id(req) else 0

    def forward(self, reqs: list[Request], contexts: list[list[int]]) -> torch.Tensor:
        """The draft's logits [B, V] after each context (its new positions computed and kept)."""
        firsts = [self.computed(r) for r in reqs]
        new = [ctx[k:] for ctx, k in zip(contexts, firsts, strict=True)]
        batch = packed_batch([r.row for r in reqs], firsts, new, [len(c) for c in contexts], self.table)
        logits = self.decoder.forward(batch, self.pool)
        for r, ctx in zip(reqs, contexts, strict=True):
            self.valid[r.row] = (id(r), len(ctx))
        return logits.float()

    def decode(self, inputs: torch.Tensor, context: int) -> torch.Tensor:
        """The draft's logits [B, V] of one decode step: `inputs` [3, B] (ids, positions, rows) on the
        device, each row's K/V written at its position; replayed from a CUDA graph where captured."""
        graphs = self.graphs
        if graphs is not None and graphs.bucket(inputs.shape[1], context) is not None:
            return graphs.run(inputs, context)
        return self.decoder.forward(
            Batch.decode(inputs[0], inputs[1], inputs[2], self.table, context), self.pool
        )

    def keep(self, req: Request, positions: int) -> None:
        owner, n = self.valid.get(req.row, (None, 0))
        if owner == id(req):
            self.valid[req.row] = (owner, min(n, positions))


class Speculator:
    """Speculative decoding for one Scheduler (module docstring); `num_steps` draft tokens per step."""

    max_batch: int | None = None
    """Decode steps of more requests than this run without speculation (`--speculative-max-batch`)."""
    gate: Gate | None = None
    """Speculation switched off where it measures slower (miles/engine/spec_gate.py,
    `--speculative-adaptive`); None: every step up to max_batch speculates."""
    _plain: tuple[int, float] | None = None
    """(requests, clock) of a plain step the gate chose, timed until `after_decode`."""

    def __init__(self, scheduler: Any, draft: Any, num_steps: int) -> None:
        if num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be at least 1, got {num_steps}")
        if draft.spec.vocab_size != scheduler.decoder.spec.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.spec.vocab_size}) is not the target's "
                f"({scheduler.decoder.spec.vocab_size}): give a draft of the same tokenizer"
            )
        self.s, self.k = scheduler, num_steps
        # each row's run of draft slots: what an average request of a full pool holds (at least 256
        # positions, at most the context), so the draft's cache is about the size of the target's;
        # a request grown past it decodes as usual
        per_row = max(scheduler.max_total_tokens // scheduler.max_running, 256)
        stride = min(scheduler.max_context, per_row) + num_steps + 1
        self.cache = DraftCache(draft, scheduler.max_running + 1, stride, scheduler.use_cuda_graph)

    def load_draft(self, weights: dict[str, torch.Tensor]) -> None:
        """New weights for the draft model (by HF name); its cached K/V is recomputed from then on."""
        self.cache.decoder.load(weights, strict=False)
        self.cache.valid.clear()

    def take_draft_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Load the draft's tensors of a weight update (`draft.<HF name>`, train.draft's push); returns
        the rest, the target's."""
        draft, rest = split_draft(weights)
        if draft:
            self.load_draft(draft)
        return rest

    def draft_weight(self, name: str) -> torch.Tensor | None:
        """The draft's tensor of update name `name` (`draft.<HF name>`), None for a target name."""
        return self.cache.decoder.get(name.removeprefix(PREFIX)) if name.startswith(PREFIX) else None

    def _room(self, r: Request) -> int:
        """Draft tokens request `r` can take this step (0: decode it as usual)."""
        if r.opts is not None or r.restricts_support or r.abort_requested:
            return 0
        left = min(r.params.max_new_tokens - len(r.output), self.s.max_context - r.num_tokens)
        room = self.cache.stride - 1 - r.num_tokens  # the draft's positions reach N + k - 2
        return max(0, min(self.k, left - 1, room))

    def step(self, reqs: list[Request]) -> list[Request]:
        """Speculate for the requests of `reqs` that can, where the gate lets it; returns the others,
        to decode as usual."""
        if self.max_batch is not None and len(reqs) > self.max_batch:
            return reqs
        gate = self.gate
        if gate is None:
            return self._round(reqs)
        if not gate.speculate(len(reqs)):
            self._plain = (len(reqs), gate.clock())
            return reqs
        start, before = gate.clock(), {id(r): r.num_tokens for r in reqs}
        rest = self._round(reqs)
        plain = {id(r) for r in rest}
        tokens = sum(r.num_tokens - before[id(r)] for r in reqs if id(r) not in plain)
        gate.record(len(reqs), True, gate.clock() - start, tokens)
        return rest

    def _round(self, reqs: list[Request]) -> list[Request]:
        """One speculative round for the requests that can; returns the others."""
        ks = {id(r): self._room(r) for r in reqs}
        mine = [r for r in reqs if ks[id(r)] > 0]
        if not mine:
            return reqs
        fresh = self.s.slots.allocate(sum(ks[id(r)] + 1 for r in mine))
        if fresh is None:  # the pool is full: the plain path retracts what it must
            return reqs
        drafts, dists = self._draft(mine, ks)
        logits = self._verify(mine, ks, drafts, fresh)
        rows = read_rows(mine, [ks[id(r)] + 1 for r in mine], logits)  # acceptance runs on the host
        self._settle(mine, ks, drafts, dists, rows)
        return [r for r in reqs if ks[id(r)] == 0]

    def _draft(self, mine: list[Request], ks: dict[int, int]):
        """k proposals per request and the draft's distributions at them (None when greedy)."""
        k = greedy_chain(mine, ks)
        if k:
            return self._draft_greedy(mine, k)
        drafts: dict[int, list[int]] = {id(r): [] for r in mine}
        dists: dict[int, list[torch.Tensor]] = {id(r): [] for r in mine}
        for i in range(max(ks.values())):
            live = [r for r in mine if ks[id(r)] > i]
            # one read-back per draft step: ids, or rows sampled on the host with host generators
            logits = self.cache.forward(live, [r.tokens + drafts[id(r)] for r in live])
            propose_rows(live, logits, i, drafts, dists)
        return drafts, dists

    def _draft_greedy(self, mine: list[Request], k: int) -> tuple[dict, dict]:
        """`_draft` for greedy requests of k drafts each: after the catch-up forward, the draft's argmax
        feeds its next decode step on the device (replaying the draft's decode graphs where it has
        them), one read-back for the k drafts."""
        cache, dev = self.cache, self.cache.table.device
        ids = cache.forward(mine, [r.tokens for r in mine]).argmax(dim=-1)
        out = [ids]
        where = torch.tensor([[r.row for r in mine], [r.num_tokens for r in mine]]).to(dev, non_blocking=True)
        context = min(self.s._decode_context(max(r.num_tokens for r in mine) + k), cache.stride)
        for i in range(k - 1):  # d_{i+1} at position N + i
            ids = cache.decode(torch.stack((ids, where[1] + i, where[0])), context).argmax(dim=-1)
            out.append(ids)
        for r in mine:
            cache.valid[r.row] = (id(r), r.num_tokens + k - 1)
        rows = torch.stack(out, dim=1).tolist()
        return {id(r): d for r, d in zip(mine, rows, strict=True)}, {id(r): [] for r in mine}

    def _verify(self, mine: list[Request], ks: dict[int, int], drafts, fresh: list[int]) -> torch.Tensor:
        """The target's logits [sum(k + 1), V] at [last, d1..dk] of every request, in order.

        One decode step of sum(k + 1) rows: a request's row j holds its token at position N-1+j over the
        request's own table row, so it attends that position's prefix (every row's K/V is written before
        any row attends), and the step replays the scheduler's CUDA graph of that many rows where one is
        captured. DeepSeek-V4's compressed caches pool a window's tokens per request, so its verify runs
        as a prefill of the k + 1 tokens instead."""
        s, at = self.s, 0
        head: list[list[int]] = [[], [], [], []]  # ids, positions, table rows, slots
        for r in mine:
            n = ks[id(r)] + 1
            new, at = fresh[at : at + n], at + n
            start = len(r.slots)  # = N - 1, the last token's position
            r.slots.extend(new)
            head[0] += [r.tokens[-1], *drafts[id(r)]]
            head[1] += range(start, start + n)
            head[2] += [r.row] * n
            head[3] += new
        ints = torch.tensor(head, dtype=torch.int64).to(s.table.device, non_blocking=True)
        s.table[ints[2], ints[1]] = ints[3]
        if s.decoder.spec.v4 is not None:
            return self._verify_prefill(mine, ks, drafts)
        return self._target_rows(ints[:3], s._decode_context(max(len(r.slots) for r in mine)))

    def _target_rows(self, ints: torch.Tensor, context: int) -> torch.Tensor:
        """The target's logits of one decode step over `ints` [3, R] (ids, positions, table rows) on
        the device, replaying the scheduler's CUDA graph of R rows where one is captured."""
        s = self.s
        s.decoder.hidden = None
        if s.graphs is not None and s.graphs.bucket(ints.shape[1], context) is not None:
            return s.graphs.run(ints, context)
        batch = Batch.decode(ints[0], ints[1], ints[2], s.table, context, s._lora_rows())
        return s.decoder.forward(batch, s.pool)

    def _verify_prefill(self, mine: list[Request], ks: dict[int, int], drafts) -> torch.Tensor:
        """`_verify` as a prefill-shaped forward over each request's k + 1 new tokens."""
        s = self.s
        for r in mine:
            r.output.extend(drafts[id(r)])
        batch = s._prefill_batch(mine)
        batch.last_index = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device)
        try:
            return s.decoder.forward(batch, s.pool)
        finally:
            for r in mine:
                del r.output[len(r.output) - ks[id(r)] :]

    def _settle(self, mine: list[Request], ks: dict[int, int], drafts: dict, dists: dict, rows: list) -> None:
        """Accept for every request of the round (`_accept`), then record its tokens one depth at a time,
        one `_record` call each (a token past a request's finish is dropped there)."""
        out = [
            self._accept(r, ks[id(r)], drafts[id(r)], dists[id(r)], z)
            for r, z in zip(mine, rows, strict=True)
        ]
        for j in range(max(len(tokens) for tokens, _ in out)):
            live = [
                (r, tokens[j], logps[j])
                for r, (tokens, logps) in zip(mine, out, strict=True)
                if j < len(tokens)
            ]
            self.s._record(
                [x[0] for x in live], [x[1] for x in live], [x[2] for x in live], self.s.weight_version
            )

    def _accept(
        self, r: Request, k: int, proposed: list[int], dist: list[torch.Tensor], z
    ) -> tuple[list, list]:
        """Acceptance for request `r`: keep the K/V of what stays, count, and return the tokens the step
        appends with the target's log-probs. `z`: the target's rows as `read_rows` gives them (greedy:
        argmax and log-prob; else logits)."""
        if isinstance(z, GreedyRows):
            tokens, n = greedy_accept(z.best, proposed)
            logps = z.logp[: len(tokens)]  # each emitted token is its row's argmax
        else:
            t = r.params.temperature
            logp = torch.log_softmax(z / t, dim=-1)
            gen = torch.Generator().manual_seed(_seed(r, 0))
            tokens, n = accept(logp.exp(), torch.stack(dist), proposed, gen)
            logps = [float(logp[j, tok]) for j, tok in enumerate(tokens)]
        base = len(r.slots) - (k + 1)  # N - 1
        kept = base + 1 + n  # the last token and the kept proposals
        self.s.slots.release(r.slots[kept:])
        del r.slots[kept:]
        r.kv_len = kept
        self._draft_kept(r, min(base + k, kept))  # the draft computed up to d_{k-1}
        r.spec_verify_ct += 1
        r.spec_draft_token_num += k
        r.spec_accept_token_num += n
        return tokens, logps

    def _draft_kept(self, r: Request, positions: int) -> None:
        """The draft's cache keeps `positions` of `r` (the rest was drafted past what stays)."""
        self.cache.keep(r, positions)

    def after_prefill(self, group: list[Request], batch: Any) -> None:
        """Called after each prefill forward and its sampling (the MTP draft extends over it)."""

    def after_decode(
        self, reqs: list[Request], hidden: torch.Tensor | None = None, ahead: bool = False
    ) -> None:
        """Called after each plain decode step's tokens are recorded; `hidden`: the step's hidden states
        kept with it, `ahead`: it was decoded one step ahead of its readback. The MTP draft extends over
        it first; the gate's plain step ends here, and a step decoded ahead (its bucket keeps plain
        decoding) counts toward the gate's next probe."""
        plain, self._plain = self._plain, None
        gate = self.gate
        if gate is None:
            return
        if plain is not None:
            gate.record(plain[0], False, gate.clock() - plain[1], len(reqs))
        elif ahead and (self.max_batch is None or len(reqs) <= self.max_batch):
            gate.speculate(len(reqs))


PREFIX = "draft."
"""Update names of the STANDALONE draft's tensors (miles/train/draft_model.py pushes them)."""


def split_draft(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the draft's tensors by HF name, the rest) of a weight update."""
    draft = {n.removeprefix(PREFIX): t for n, t in weights.items() if n.startswith(PREFIX)}
    return draft, {n: t for n, t in weights.items() if not n.startswith(PREFIX)} if draft else weights


def propose(r: Request, z: torch.Tensor, i: int, drafts: list[int], dists: list[torch.Tensor]) -> None:
    """Draft token i of request `r` from the draft's logits `z` [V]: its argmax when greedy, else a
    sample of q = softmax(z / T) (seeded per request and position), q kept for the acceptance rule."""
    t = r.params.temperature
    if t <= 0:
        drafts.append(int(z.argmax()))
        return
    q = torch.softmax(z / t, dim=-1)
    gen = torch.Generator().manual_seed(_seed(r, 1 + i))
    drafts.append(int(torch.multinomial(q, 1, generator=gen)))
    dists.append(q)


def _seed(r: Request, salt: int) -> int:
    """A seed of the request's seed, its length and `salt` (reproducible, distinct per draw)."""
    return (r.seed * 1_000_003 + r.num_tokens * 7919 + salt) & 0x7FFF_FFFF_FFFF_FFFF


# ---- the engine's command line (SGLang's flags) -------------------------------------------------------


def add_args(p: Any) -> None:
    p.add_argument(
        "--speculative-algorithm",
        choices=["EAGLE", "EAGLE3", "NEXTN", "STANDALONE"],
        default=None,
        help="speculative decoding; this engine runs STANDALONE (a separate draft model) and NEXTN (the "
        "model's own MTP layer, config num_nextn_predict_layers)",
    )
    p.add_argument("--speculative-draft-model-path", default=None, help="the draft model's HF directory")
    p.add_argument(
        "--speculative-max-batch",
        type=int,
        default=None,
        help="speculate only in decode steps of at most this many requests (this engine's own flag; "
        "default: every step)",
    )
    p.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per batch size, measure speculative rounds against plain decode steps and keep the faster, "
        "probing the other now and then (this engine's own flag; miles/engine/spec_gate.py)",
    )
    p.add_argument("--speculative-num-steps", type=int, default=3, help="draft tokens per step")
    p.add_argument("--speculative-eagle-topk", type=int, default=1, help="draft branches (1: a chain)")
    p.add_argument(
        "--speculative-num-draft-tokens", type=int, default=None, help="tokens verified: num-steps + 1"
    )


def problem(args: Any) -> str | None:
    """Why the speculative flags cannot run here (naming the flag to change); None when they can."""
    algo = args.speculative_algorithm
    if algo is None:
        return None
    if algo not in ALGORITHMS:
        return (
            f"--speculative-algorithm {algo} drafts with EAGLE heads, which this engine does not load: use "
            "NEXTN (the model's MTP layer) or STANDALONE with --speculative-draft-model-path"
        )
    if algo == "STANDALONE" and not args.speculative_draft_model_path:
        return "--speculative-algorithm STANDALONE needs --speculative-draft-model-path DIR (the draft model)"
    if args.speculative_eagle_topk != 1:
        return "--speculative-eagle-topk must be 1 here (a chain of drafts, no tree)"
    if args.speculative_num_steps < 1:
        return "--speculative-num-steps must be at least 1"
    drafted = args.speculative_num_draft_tokens
    if drafted is not None and drafted != args.speculative_num_steps + 1:
        return (
            f"--speculative-num-draft-tokens {drafted} must be --speculative-num-steps + 1 "
            f"({args.speculative_num_steps + 1}) with a chain of drafts"
        )
    return None


def fit_verify_graphs(scheduler: Any) -> None:
    """Widen the scheduler's captured decode steps to a verify's rows: k + 1 per request of the largest
    batch that may speculate, min(the captured batch size, max_batch), so that a verify replays a graph
    rather than running eagerly. Graphs are captured on first use: only the sizes that come cost memory."""
    sp = scheduler.speculator
    rows = min(scheduler.graph_max_bs, sp.max_batch or scheduler.graph_max_bs) * (sp.k + 1)
    if rows > scheduler.graph_rows:
        scheduler.capture_up_to(rows)


def attach(args: Any, scheduler: Any, device: str, dtype: torch.dtype) -> None:
    """Give `scheduler` a Speculator over the draft model the flags name (nothing without them;
    NEXTN: miles/engine/mtp.py `attach`)."""
    if args.speculative_algorithm is None:
        return
    from pathlib import Path

    from miles.engine.fp8_weights import DEFAULT_FP8_MIN_TOKENS, build_decoder
    from miles.engine.model import ModelSpec

    path = Path(args.speculative_draft_model_path)
    spec = ModelSpec.from_dir(path)
    draft = build_decoder(spec, path, device, dtype, "none", DEFAULT_FP8_MIN_TOKENS)
    scheduler.speculator = Speculator(scheduler, draft, args.speculative_num_steps)
    scheduler.speculator.max_batch = args.speculative_max_batch
    scheduler.speculator.gate = Gate() if args.speculative_adaptive else None
    fit_verify_graphs(scheduler)
    log.info(
        "speculative decoding: STANDALONE, draft %s (%s), %d draft tokens per verify",
        path,
        spec.arch,
        args.speculative_num_steps,
    )
