"""Speculative decoding with the model's own multi-token-prediction layer (SGLang's
`--speculative-algorithm NEXTN`): DeepSeek-V3's MTP, or the one-layer head `miles model init-tiny
--mtp` gives a tiny model.

The MTP layer L (= num_hidden_layers, weights `model.layers.L.*`) predicts the token after next: at
position t it takes the target's final-normed hidden state h_t and the embedding of token t+1,
    u_t = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)])
runs one decoder layer of the model's own kind over u (its attention over its own K/V of positions
<= t), normalises (`shared_head.norm`) and applies the shared LM head: a distribution of x_{t+2}.
Embedding and LM head are the target's own tensors, read at each forward (the copies a DeepSeek-V3
checkpoint keeps in the MTP layer are the same weights and are not loaded).

Its K/V lives in a pool of its own indexed by the target's slots, so a prefix the target shares
between requests (the radix cache) shares the MTP's K/V too. Per request the speculator keeps the
MTP's output after the request's last consumed token (`_State`: logits and hidden state), valid while
the MTP has consumed every token but the newest (decode state: x_0..x_{N-1} with x_{N-1} not yet
forwarded by the target, MTP positions 0..N-2 computed):

1. after a prefill (`after_prefill`), the MTP extends over the prefill's positions with the
   target's hidden states of them and the tokens one ahead (the sampled token last);
2. a step drafts d1 from the kept logits, then d2..dk by running the MTP on its own output hidden
   state in place of the target's, one position further each time (chain drafting, as SGLang's
   NEXTN with several steps);
3. the target verifies [x_{N-1}, d1..dk] (miles/engine/speculative.py: exact rejection sampling, the
   target's log-probs), and the MTP extends over the kept positions N-1..N-1+n with the target's
   hidden states of the verify, overwriting what the chain wrote there.

A request that decodes a step without speculating (a batch above `--speculative-max-batch`, its
options, the pool full) keeps its MTP history: after the plain decode step the layer extends over the
position it forwarded (`after_decode`, from the hidden states the decode forward or its CUDA graph
leaves). Only a step with no hidden states (none in this engine) leaves a gap, after which the
request decodes as usual. Verification keeps every output the target's, so the
MTP only sets how many drafts are kept.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from miles.engine.request import Request, pack_tokens, packed_batch
from miles.engine.spec import Batch
from miles.engine.spec_gate import Gate
from miles.engine.speculative import (
    GreedyRows,
    Speculator,
    fit_verify_graphs,
    greedy_chain,
    propose_rows,
    read_rows,
    split_draft,
)
from miles.models.mtp import INPUT, OWN, mtp_prefix

log = logging.getLogger("miles.engine")


class MtpDraft:
    """The MTP layer as a one-layer decoder with its own input projection (module docstring)."""

    def __init__(self, target: Any, weights: dict[str, torch.Tensor], num_slots: int) -> None:
        from miles.engine.model import Decoder

        spec, pre = target.spec, mtp_prefix(target.spec.num_layers)
        mine = {n.removeprefix(pre): t for n, t in weights.items() if n.startswith(pre)}
        if missing := [n for n in OWN if n not in mine]:
            raise ValueError(f"the checkpoint's MTP layer ({pre}*) lacks {missing}")
        sparse = any(n.startswith("mlp.experts.") or n == "mlp.gate.weight" for n in mine)
        moe = spec.moe and dataclasses.replace(spec.moe, sparse_layers=(0,) if sparse else ())
        one = dataclasses.replace(spec, num_layers=1, mtp_layers=0, moe=moe, tie_word_embeddings=False)
        layer = {_layer_name(n): t for n, t in mine.items() if n not in _SHARED and n not in INPUT}
        layer.update({n: target.get(n) for n in _HEAD})
        self.target = target
        self.decoder = Decoder(one, layer, str(target.device), target.dtype)
        for n in _HEAD:  # the target's own tensors serve, bound before each forward (`_bind_head`)
            self.decoder.storage.pop(n, None)
        self.decoder.fused = self.decoder.paged_decode = self.decoder.row_decode = False
        self.decoder.capture_hidden = True
        self.own = {n: mine[n].to(target.device, target.dtype) for n in INPUT}
        self.prefix = pre
        self.pool = self.decoder.new_kv_pool(num_slots)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """New MTP weights by their checkpoint names (`model.layers.L.*`; the embedding and LM head
        copies are the target's and are skipped)."""
        mine = {n.removeprefix(self.prefix): t for n, t in weights.items() if n.startswith(self.prefix)}
        for n in self.own:
            if n in mine:
                self.own[n].copy_(mine.pop(n))
        renamed = {_layer_name(n): t for n, t in mine.items() if n not in _SHARED}
        if renamed:
            self.decoder.load(renamed)

    def get(self, name: str) -> torch.Tensor:
        """The MTP weight of checkpoint name `name` (KeyError when it has none)."""
        n = name.removeprefix(self.prefix)
        if n in self.own:
            return self.own[n]
        return self.decoder.get(_layer_name(n))

    def _bind_head(self) -> None:
        """The target's embedding and LM head as they are now (weight pushes, memory release and
        resume give the target new tensors)."""
        for n in _HEAD:
            self.decoder.params[n] = self.target.get(n)

    def _inputs(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        norm, own = self.decoder._norm, self.own  # the decoder's RMSNorm (HF's roundings)
        emb = self.decoder.params["model.embed_tokens.weight"][next_ids]
        both = torch.cat((norm(emb, own["enorm.weight"]), norm(hidden, own["hnorm.weight"])), -1)
        return F.linear(both, own["eh_proj.weight"])

    @torch.inference_mode()
    def forward(self, runs: list[tuple[int, list[int], torch.Tensor, int]], table: torch.Tensor):
        """One MTP forward over runs (table row, the tokens one ahead of positions start.., the
        hidden states [m, hidden] of those positions, start): (logits [R, V] fp32 and final-normed
        hidden [R, hidden]) at each run's last position. K/V written at the table's slots."""
        self._bind_head()
        b = _batch(runs, table)
        b.input_embeds = self._inputs(
            torch.cat([h for _, _, h, _ in runs]).to(self.decoder.dtype), b.input_ids
        )
        logits = self.decoder.forward(b, self.pool)
        return logits.float(), self.decoder.hidden[b.last_index]

    def rows_hidden(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor,
                    table: torch.Tensor, context: int) -> torch.Tensor:  # fmt: skip
        """One decode-shaped MTP forward, all on the device: row i at position `positions[i]` of table row
        `rows[i]` over the hidden state `hidden[i]` and the token one ahead `ids[i]` (each row attends
        its own position's prefix, every row's K/V written first); the MTP's final-normed hidden states
        [R, h], without the LM head (`logits` gives the rows wanted theirs), so a captured forward
        holds no [R, V] output."""
        self._bind_head()
        b = Batch.decode(ids, positions, rows, table, context)
        b.last_index = b.last_index[:1]
        b.input_embeds = self._inputs(hidden.to(self.decoder.dtype), ids)
        self.decoder.forward(b, self.pool)
        return self.decoder.hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed MTP hidden states [n, h] (the target's LM head)."""
        self._bind_head()
        return self.decoder._logits(hidden)

    def chain(self, rows: torch.Tensor, start: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor,
              steps: int, table: torch.Tensor, context: int) -> torch.Tensor:  # fmt: skip
        """Greedy drafts [B, steps + 1] on the device, no host read between them: d1 = the argmax of
        `logits` [B, V] (the kept MTP outputs), then `steps` MTP forwards, each at position start + i
        (`start` [B]: N - 1) of table row `rows` [B] over its own output hidden state (`hidden` [B, h]
        first) and the draft before. Shapes and addresses depend on B, steps and `context` alone, so
        `ChainGraphs` captures it."""
        ids = logits.argmax(dim=-1)
        out = [ids]
        for i in range(steps):
            hidden = self.rows_hidden(ids, start + i, rows, hidden, table, context)
            ids = self.logits(hidden).argmax(dim=-1)
            out.append(ids)
        return torch.stack(out, dim=1)


FOLLOW_EVERY = 32
"""Plain decode steps whose hidden states the MTP takes in one forward (sooner when a round needs them):
a plain step then pays for one MTP launch sequence in that many, and the queue holds that many copies of
a step's hidden states."""
SHORT_RUN = 8
"""Runs of at most this many tokens (a verify's kept drafts, a few queued plain steps) forward
decode-shaped: the MTP decoder's attention gathers each row's context (its forward is the per-op one,
on a GPU too), so a decode-shaped forward of B x FOLLOW_EVERY rows would gather B x FOLLOW_EVERY
contexts."""


def _batch(runs: list[tuple[int, list[int], torch.Tensor, int]], table: torch.Tensor) -> Batch:
    """The MTP forward's batch, its `last_index` each run's last token. Short runs: decode-shaped, one
    row per token over its run's table row (each row attends its own position's prefix, every row's
    K/V written first), built from one host-to-device copy; else (a prefill's runs) prefill-shaped."""
    rows, new, starts = [row for row, *_ in runs], [ids for _, ids, _, _ in runs], [s for *_, s in runs]
    if max(map(len, new)) > SHORT_RUN:
        return packed_batch(
            rows, starts, new, [s + len(ids) for s, ids in zip(starts, new, strict=True)], table
        )
    host, counts = pack_tokens(rows, starts, new)  # decode-shaped: ids, positions, rows, then last indices
    ints = np.zeros((4, host.shape[1]), dtype=np.int64)
    ints[:3], ints[3, : len(runs)] = host, np.cumsum(counts) - 1
    dev = torch.from_numpy(ints).to(table.device, non_blocking=True)
    b = Batch.decode(dev[0], dev[1], dev[2], table, int(host[1].max()) + 1)
    b.last_index = dev[3, : len(runs)]
    return b


_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
"""The MTP layer's copies of the embedding and the LM head (DeepSeek-V3 stores them): the target's serve."""
_HEAD = ("model.embed_tokens.weight", "lm_head.weight")


def _layer_name(n: str) -> str:
    """The one-layer decoder's name of MTP weight `n` (relative to model.layers.L.)."""
    return "model.norm.weight" if n == "shared_head.norm.weight" else f"model.layers.0.{n}"


@dataclasses.dataclass
class _State:
    upto: int
    """MTP positions computed: 0 .. upto - 1 (valid for drafting when upto == num_tokens - 1)."""
    all_logits: torch.Tensor
    all_hidden: torch.Tensor
    i: int
    """The MTP's output of the request: row i of the forward's logits and hidden states (indexed when
    drafting, so a forward over many requests makes no view per request)."""

    @property
    def logits(self) -> torch.Tensor:
        return self.all_logits[self.i]

    @property
    def hidden(self) -> torch.Tensor:
        return self.all_hidden[self.i]


class MtpSpeculator(Speculator):
    """Speculator whose draft is the model's MTP layer (module docstring)."""

    def __init__(self, scheduler: Any, mtp: MtpDraft, num_steps: int) -> None:
        if num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be at least 1, got {num_steps}")
        self.s, self.k, self.mtp = scheduler, num_steps, mtp
        self.state: weakref.WeakKeyDictionary[Request, _State] = weakref.WeakKeyDictionary()
        self.queue: list[tuple[tuple[Request, ...], torch.Tensor]] = []
        """Plain steps not yet taken by the MTP: the step's requests and its hidden states [B, h] (a
        copy), row i request i's."""
        scheduler.decoder.capture_hidden = True
        scheduler.decoder.row_decode = False  # the CPU row decode leaves no hidden states
        self.chains = self.row_graphs = None
        """The CUDA graphs (miles/engine/mtp_graphs.py) of the greedy chain and of the layer over a round's
        rows, where the scheduler captures its decode steps, else None (eager)."""
        if scheduler.use_cuda_graph:
            from miles.engine.mtp_graphs import ChainGraphs, RowsGraphs

            batch = min(scheduler.graph_max_bs, 64)
            context = min(scheduler.graph_max_context, scheduler.max_context)
            self.chains = ChainGraphs(mtp, scheduler.table, scheduler.max_running, batch, context)
            self.row_graphs = RowsGraphs(
                mtp, scheduler.table, scheduler.max_running, batch * (num_steps + 1), context
            )

    def load_draft(self, weights: dict[str, torch.Tensor]) -> None:
        """New MTP weights (a weight push); kept states draft on, verification keeps outputs exact."""
        self.mtp.load(weights)

    def take_draft_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Load the MTP layer's tensors of a weight update (its checkpoint names, `model.layers.L.*`:
        train.draft's push); returns the rest, the target's (a STANDALONE `draft.*` push is dropped)."""
        mine = {n: t for n, t in weights.items() if n.startswith(self.mtp.prefix)}
        if mine:
            self.load_draft(mine)
        return {n: t for n, t in split_draft(weights)[1].items() if n not in mine}

    def draft_weight(self, name: str) -> torch.Tensor | None:
        """The MTP layer's tensor of checkpoint name `name`, None for a target name."""
        return self.mtp.get(name) if name.startswith(self.mtp.prefix) else None

    def _room(self, r: Request) -> int:
        st = self.state.get(r)
        if (
            st is None
            or st.upto != r.num_tokens - 1
            or r.opts is not None
            or r.restricts_support
            or r.abort_requested
        ):
            return 0
        left = min(r.params.max_new_tokens - len(r.output), self.s.max_context - r.num_tokens)
        return max(0, min(self.k, left - 1))

    def _round(self, reqs: list[Request]) -> list[Request]:
        """Speculate for the requests that can (`_room`); returns the others, to decode as usual (the
        MTP then extends over their step too, `after_decode`, as over any plain step)."""
        self._flush()  # the rows of plain steps not taken yet
        ks = {id(r): self._room(r) for r in reqs}
        mine = [r for r in reqs if ks[id(r)] > 0]
        fresh = self.s.slots.allocate(sum(ks[id(r)] + 1 for r in mine)) if mine else None
        if fresh is None:
            return reqs
        self._prepare(mine, ks, fresh)
        k = greedy_chain(mine, ks) if self.s.decoder.spec.v4 is None else 0
        if k:
            self._round_greedy(mine, k, fresh)
        else:
            self._round_any(mine, ks, fresh)
        return [r for r in reqs if ks[id(r)] == 0]

    def _round_any(self, mine: list[Request], ks: dict[int, int], fresh: list[int]) -> None:
        """A round of any requests: drafts read back before the verify is built, acceptance on the
        host, then the MTP over each request's kept positions."""
        drafts, dists = self._draft(mine, ks)
        before = {id(r): r.num_tokens for r in mine}
        logits = self._verify(mine, ks, drafts, fresh)
        hidden = self.s.decoder.hidden  # the target's, of [x_{N-1}, d1..dk] per request
        rows = read_rows(mine, [ks[id(r)] + 1 for r in mine], logits)  # acceptance runs on the host
        self._settle(mine, ks, drafts, dists, rows)
        runs, kept, at = [], [], 0
        for r in mine:
            k, n0 = ks[id(r)], before[id(r)]
            new = r.num_tokens - n0  # the kept drafts and the target's token after them
            if r.finish is None:
                runs.append((r.row, r.tokens[n0 : n0 + new], hidden[at : at + new], n0 - 1))
                kept.append(r)
            else:
                self._drop(r)
            at += k + 1
        self._extend(kept, runs)

    def _round_greedy(self, mine: list[Request], k: int, fresh: list[int]) -> None:
        """A round of greedy requests of k drafts each, on the device up to one read-back: the chain,
        the verify over [x_{N-1}, d1..dk] (its ids the chain's output), the target's argmax and
        log-prob per row, the kept count n per request, and the MTP over all k + 1 positions with the
        target's argmax one ahead (equal to the kept tokens up to position N-1+n; what it writes past
        that is rewritten before it is read, as the chain's drafts are), its output at N-1+n kept."""
        s, n1, dev = self.s, k + 1, self.s.table.device
        for r, at in zip(mine, range(0, len(fresh), n1), strict=True):
            r.slots.extend(fresh[at : at + n1])
        ints = torch.tensor([[r.row for r in mine], [r.num_tokens - 1 for r in mine],
                             [r.tokens[-1] for r in mine]]).to(dev, non_blocking=True)  # fmt: skip
        context = s._decode_context(max(len(r.slots) for r in mine))
        logits = torch.stack([self.state[r].logits for r in mine])
        hidden = torch.stack([self.state[r].hidden for r in mine])
        run = self.chains.run if self.chains is not None else self.mtp.chain
        drafts = run(ints[0], ints[1], logits, hidden, k - 1, s.table, context)  # [B, k]
        grid = (torch.cat((ints[2][:, None], drafts), 1), ints[1][:, None] + torch.arange(n1, device=dev),
                ints[0][:, None].expand(-1, n1))  # fmt: skip
        flat = torch.stack(grid).reshape(3, -1)  # ids, positions, table rows of the B * (k + 1) rows
        z = self._target_rows(flat, context)
        best = z.argmax(dim=-1)
        logp = torch.log_softmax(z.float(), dim=-1).gather(1, best[:, None])[:, 0]
        n = (drafts == best.view(-1, n1)[:, :k]).int().cumprod(dim=1).sum(dim=1)
        run = self.row_graphs.run if self.row_graphs is not None else self.mtp.rows_hidden
        hm = run(best, flat[1], flat[2], s.decoder.hidden, s.table, context)
        kept_h = hm[torch.arange(len(mine), device=dev) * n1 + n]
        kept_z = self.mtp.logits(kept_h)
        host = torch.cat((drafts.reshape(-1).double(), best.double(), logp.double())).cpu().tolist()
        at_best, at_logp = len(mine) * k, len(mine) * (k + n1)
        rows = [GreedyRows([int(t) for t in host[at_best + i * n1 : at_best + (i + 1) * n1]],
                           host[at_logp + i * n1 : at_logp + (i + 1) * n1]) for i in range(len(mine))]  # fmt: skip
        drafts = {id(r): [int(t) for t in host[i * k : (i + 1) * k]] for i, r in enumerate(mine)}
        self._settle(mine, dict.fromkeys(drafts, k), drafts, dict.fromkeys(drafts, []), rows)
        for i, r in enumerate(mine):
            if r.finish is None:
                self._keep(r, r.num_tokens - 1, kept_z, kept_h, i)
            else:
                self._drop(r)

    def after_decode(
        self, reqs: list[Request], hidden: torch.Tensor | None = None, ahead: bool = False
    ) -> None:
        """The MTP over the position a plain decode step forwarded (`hidden`: the step's hidden states,
        a copy kept with a step recorded from flight, else the decoder's last; the token sampled after
        it), for the requests whose history reaches it; then the gate's plain step ends."""
        if hidden is None and self.s.decoder.hidden is not None:
            hidden = self.s.decoder.hidden.clone()  # a CUDA graph's buffer, rewritten by the next step
        self._follow(reqs, hidden)
        super().after_decode(reqs, hidden, ahead)

    def _follow(self, reqs: list[Request], hidden: torch.Tensor | None) -> None:
        """Queue the step (its requests and hidden states, no per-request work); the MTP takes the queue
        in one forward every FOLLOW_EVERY steps, or before a round. A step without hidden states leaves
        a gap in its requests' histories, which `_flush` finds."""
        if hidden is None or hidden.shape[0] < len(reqs):
            return
        self.queue.append((tuple(reqs), hidden))
        if len(self.queue) >= FOLLOW_EVERY:
            self._flush()

    def _flush(self) -> None:
        """The MTP over the queued steps' rows of each request whose history they continue (positions
        upto.. of its kept state, the tokens one ahead), in one forward. A request's n queued steps
        forwarded its positions num_tokens - 1 - n .. num_tokens - 2 (one token each, recorded before
        the flush); unless they start where its kept state ends, a step is missing and its history ends."""
        steps, self.queue = self.queue, []
        if not steps:
            return
        if all(reqs == steps[0][0] for reqs, _ in steps):  # the same requests each step (tuples: in C)
            reqs, n = steps[0][0], len(steps)
            hidden = torch.stack([h[: len(reqs)] for _, h in steps], dim=1)  # [B, n, h], request by request
            where = {r: range(i * n, (i + 1) * n) for i, r in enumerate(reqs)}
            self._extend_from(where, hidden.flatten(0, 1), in_order=True)
            return
        where: dict[Request, list[int]] = {}
        base, at = 0, 0
        while at < len(steps):  # consecutive steps of the same requests in one pass
            reqs, bases = steps[at][0], []
            while at < len(steps) and steps[at][0] == reqs:
                bases.append(base)
                base += steps[at][1].shape[0]
                at += 1
            for i, r in enumerate(reqs):
                where.setdefault(r, []).extend([b + i for b in bases])
        self._extend_from(where, torch.cat([h for _, h in steps]), in_order=False)

    def _extend_from(self, where: dict[Request, Any], hidden: torch.Tensor, in_order: bool) -> None:
        """`_flush`'s forward: request r's queued rows are `hidden[where[r]]`, in step order (`in_order`:
        `where` lists hidden's rows in order, so with no request dropped no gather is needed)."""
        spans, kept, order = [], [], []
        for r, ix in where.items():
            st = self.state.get(r)
            if st is None or r.finish is not None or r.row < 0 or r.num_tokens - 1 - len(ix) != st.upto:
                self._drop(r)
                in_order = False
                continue
            spans.append((r.row, r.tokens[st.upto + 1 : st.upto + 1 + len(ix)], len(order), st.upto))
            kept.append(r)
            order += ix
        if not kept:
            return
        if not in_order:
            hidden = hidden[torch.tensor(order).to(hidden.device, non_blocking=True)]
        runs = [(row, ids, hidden[at : at + len(ids)], start) for row, ids, at, start in spans]
        self._extend(kept, runs)

    def _keep(self, r: Request, upto: int, logits: torch.Tensor, hidden: torch.Tensor, i: int) -> None:
        """The MTP's output after position upto - 1 of `r` (row i of `logits`, `hidden`): the state its
        next draft starts from."""
        self.state[r] = _State(upto, logits, hidden, i)

    def _drop(self, r: Request) -> None:
        """`r` has no MTP history from here on (it decodes as usual)."""
        self.state.pop(r, None)

    def _draft_kept(self, r: Request, positions: int) -> None:
        """The MTP's own positions are rewritten by the extend after each verify."""

    def after_prefill(self, group: list[Request], batch) -> None:
        """The MTP over each prefilled request's new positions (the target's hidden states of them)."""
        hidden, ends = self.s.decoder.hidden, batch.last_index[: len(group)].tolist()
        begins = [0] + [e + 1 for e in ends[:-1]]
        starts = batch.positions[torch.tensor(begins, device=batch.positions.device)].tolist()
        runs, kept, begin = [], [], 0
        for r, end, start in zip(group, ends, starts, strict=True):
            if r.finish is None and r.opts is None and len(r.output) and r.row >= 0:
                ids = r.tokens[start + 1 : end - begin + start + 2]
                runs.append((r.row, ids, hidden[begin : end + 1], start))
                kept.append(r)
            begin = end + 1
        self._extend(kept, runs)

    def _extend(self, reqs: list[Request], runs) -> None:
        if not runs:
            return
        logits, hidden = self.mtp.forward(runs, self.s.table)
        for i, (r, (_, ids, _, start)) in enumerate(zip(reqs, runs, strict=True)):
            self._keep(r, start + len(ids), logits, hidden, i)

    def _draft(self, mine: list[Request], ks: dict[int, int]):
        """d1 from each request's kept MTP logits, then d2.. from the MTP on its own hidden state, at
        positions N-1.. (slots the step allocated for them, their table entries written by `_prepare`)."""
        drafts: dict[int, list[int]] = {id(r): [] for r in mine}
        dists: dict[int, list[torch.Tensor]] = {id(r): [] for r in mine}
        logits = torch.stack([self.state[r].logits for r in mine])
        hidden = [self.state[r].hidden for r in mine]
        live = list(mine)
        for i in range(max(ks.values())):
            propose_rows(live, logits, i, drafts, dists)
            live_next = [(j, r) for j, r in enumerate(live) if ks[id(r)] > i + 1]
            if not live_next:
                break
            runs = [(r.row, [drafts[id(r)][-1]], hidden[j][None], r.num_tokens - 1 + i) for j, r in live_next]
            z, h = self.mtp.forward(runs, self.s.table)
            live, logits, hidden = [r for _, r in live_next], z, list(h)
        return drafts, dists

    def _prepare(self, mine: list[Request], ks: dict[int, int], fresh: list[int]) -> None:
        """Table entries of the step's fresh slots before drafting (the chain writes K/V there)."""
        rows, positions = [], []
        for r in mine:
            n = ks[id(r)] + 1
            rows += [r.row] * n
            positions += range(len(r.slots), len(r.slots) + n)
        ints = torch.tensor([rows, positions, fresh], dtype=torch.int64).to(
            self.s.table.device, non_blocking=True
        )
        self.s.table[ints[0], ints[1]] = ints[2]


def load_mtp(model_dir: str | Path, target: Any, num_slots: int) -> MtpDraft:
    """The MTP draft of the checkpoint in `model_dir` (ValueError naming what is missing)."""
    from miles.engine.model import load_weights

    if not target.spec.mtp_layers:
        raise ValueError(
            f"{model_dir} has no MTP layer (config num_nextn_predict_layers): NEXTN drafts with the model's "
            "own MTP layer; use STANDALONE with --speculative-draft-model-path, or `miles model init-tiny --mtp`"
        )
    pre = mtp_prefix(target.spec.num_layers)
    weights = load_weights(model_dir, prefix=pre)
    return MtpDraft(target, weights, num_slots)


def attach(args: Any, scheduler: Any, device: str, dtype: torch.dtype) -> None:
    """`--speculative-algorithm NEXTN`: give `scheduler` an MtpSpeculator over the model's MTP layer."""
    mtp = load_mtp(args.model, scheduler.decoder, scheduler.max_total_tokens + 1)
    scheduler.speculator = MtpSpeculator(scheduler, mtp, args.speculative_num_steps)
    scheduler.speculator.max_batch = args.speculative_max_batch
    scheduler.speculator.gate = Gate() if args.speculative_adaptive else None
    fit_verify_graphs(scheduler)
    log.info("speculative decoding: NEXTN, the MTP layer of %s, %d draft tokens per verify",
             args.model, args.speculative_num_steps)  # fmt: skip
