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
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from miles.engine.request import Request, prefill_batch
from miles.engine.spec import Batch
from miles.engine.spec_gate import Gate
from miles.engine.speculative import Speculator, greedy_chain, propose_rows, read_rows, split_draft
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
        b, last = _batch(runs, table)
        b.input_embeds = self._inputs(
            torch.cat([h for _, _, h, _ in runs]).to(self.decoder.dtype), b.input_ids
        )
        logits = self.decoder.forward(b, self.pool)
        return logits[last].float(), self.decoder.hidden[b.last_index[last]]

    def chain(self, rows: torch.Tensor, start: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor,
              steps: int, table: torch.Tensor, context: int) -> torch.Tensor:  # fmt: skip
        """Greedy drafts [B, steps + 1] on the device, no host read between them: d1 = the argmax of
        `logits` [B, V] (the kept MTP outputs), then `steps` MTP forwards, each at position start + i
        (`start` [B]: N - 1) of table row `rows` [B] over its own output hidden state (`hidden` [B, h]
        first) and the draft before. Shapes and addresses depend on B, steps and `context` alone, so
        `ChainGraphs` captures it."""
        self._bind_head()
        ids = logits.argmax(dim=-1)
        out = [ids]
        for i in range(steps):
            b = Batch.decode(ids, start + i, rows, table, context)
            b.input_embeds = self._inputs(hidden.to(self.decoder.dtype), ids)
            ids = self.decoder.forward(b, self.pool).argmax(dim=-1)
            hidden = self.decoder.hidden
            out.append(ids)
        return torch.stack(out, dim=1)


SHORT_RUN = 8
"""Runs of at most this many tokens (a verify's kept drafts, a chain step) forward decode-shaped..."""
SHORT_TOTAL = 256
"""... while they hold at most this many tokens together (each row gathers its whole context)."""
FOLLOW_EVERY = 8
"""Plain steps of a batch above --speculative-max-batch whose hidden states the MTP takes at once."""


def _batch(
    runs: list[tuple[int, list[int], torch.Tensor, int]], table: torch.Tensor
) -> tuple[Batch, list[int]]:
    """The MTP forward's batch and the index of each run's last token in it. Short runs: decode-shaped,
    one row per token over its run's table row (each row attends its own position's prefix, every row's
    K/V written first), built from one host-to-device copy; else (a prefill's runs) prefill-shaped."""
    lengths = [len(ids) for _, ids, _, _ in runs]
    if max(lengths) <= SHORT_RUN and sum(lengths) <= SHORT_TOTAL:
        head: list[list[int]] = [[], [], []]
        last = []
        for row, ids, _, start in runs:
            head[0] += ids
            head[1] += range(start, start + len(ids))
            head[2] += [row] * len(ids)
            last.append(len(head[0]) - 1)
        ints = torch.tensor(head, dtype=torch.int64).to(table.device, non_blocking=True)
        return Batch.decode(ints[0], ints[1], ints[2], table, max(head[1]) + 1), last
    fake = [SimpleNamespace(tokens=[0] * start + ids, kv_len=start, row=row, slots=range(start + len(ids)))
            for row, ids, _, start in runs]  # fmt: skip
    return prefill_batch(fake, table), list(range(len(runs)))


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
    logits: torch.Tensor
    hidden: torch.Tensor


class MtpSpeculator(Speculator):
    """Speculator whose draft is the model's MTP layer (module docstring)."""

    def __init__(self, scheduler: Any, mtp: MtpDraft, num_steps: int) -> None:
        if num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be at least 1, got {num_steps}")
        self.s, self.k, self.mtp = scheduler, num_steps, mtp
        self.state: weakref.WeakKeyDictionary[Request, _State] = weakref.WeakKeyDictionary()
        self.pending: weakref.WeakKeyDictionary[Request, list[torch.Tensor]] = weakref.WeakKeyDictionary()
        """Hidden states [h] of plain steps past `state`'s position, not yet taken by the MTP."""
        scheduler.decoder.capture_hidden = True
        scheduler.decoder.row_decode = False  # the CPU row decode leaves no hidden states
        self.chains = None
        """The greedy chain's CUDA graphs (miles/engine/mtp_graphs.py) where the scheduler captures its
        decode steps, else None (eager)."""
        if scheduler.use_cuda_graph:
            from miles.engine.mtp_graphs import ChainGraphs

            self.chains = ChainGraphs(mtp, scheduler.table, scheduler.max_running, min(scheduler.graph_max_bs, 64),
                                      min(scheduler.graph_max_context, scheduler.max_context))  # fmt: skip

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
        self._flush([r for r in reqs if r in self.pending])  # rows of big batches' plain steps
        ks = {id(r): self._room(r) for r in reqs}
        mine = [r for r in reqs if ks[id(r)] > 0]
        fresh = self.s.slots.allocate(sum(ks[id(r)] + 1 for r in mine)) if mine else None
        if fresh is None:
            return reqs
        self._prepare(mine, ks, fresh)
        drafts, dists = self._draft(mine, ks)
        before = {id(r): r.num_tokens for r in mine}
        logits = self._verify(mine, ks, drafts, fresh)
        hidden = self.s.decoder.hidden  # the target's, of [x_{N-1}, d1..dk] per request
        rows = read_rows(mine, [ks[id(r)] + 1 for r in mine], logits)  # acceptance runs on the host
        runs, kept, at = [], [], 0
        for r, got in zip(mine, rows, strict=True):
            k, n0 = ks[id(r)], before[id(r)]
            self._settle(r, k, drafts[id(r)], dists[id(r)], got)
            new = r.num_tokens - n0  # the kept drafts and the target's token after them
            if r.finish is None:
                runs.append((r.row, r.tokens[n0 : n0 + new], hidden[at : at + new], n0 - 1))
                kept.append(r)
            else:
                self.state.pop(r, None)
            at += k + 1
        self._extend(kept, runs)
        return [r for r in reqs if ks[id(r)] == 0]

    def after_decode(self, reqs: list[Request], hidden: torch.Tensor | None = None) -> None:
        """The MTP over the position a plain decode step forwarded (`hidden`: the step's hidden states,
        the decoder's last by default; the token sampled after it), for the requests whose history
        reaches it; then the gate's plain step ends, the extension included."""
        self._follow(reqs, self.s.decoder.hidden if hidden is None else hidden)
        super().after_decode(reqs)

    def _follow(self, reqs: list[Request], hidden: torch.Tensor | None) -> None:
        """Each request's hidden state of the step joins its pending rows (a gap drops its history);
        the MTP takes pending rows in one forward where the batch may speculate, else every
        FOLLOW_EVERY steps (a big batch's plain steps pay one MTP launch sequence per that many)."""
        if hidden is None or hidden.shape[0] < len(reqs):
            return
        for i, r in enumerate(reqs):
            st = self.state.get(r)
            if st is None or r.finish is not None:
                continue
            rows = self.pending.setdefault(r, [])
            if st.upto + len(rows) == r.num_tokens - 2:  # the step forwarded position num_tokens - 2
                rows.append(hidden[i])
            else:
                self.pending.pop(r, None)
                self.state.pop(r, None)
        small = self.max_batch is None or len(reqs) <= self.max_batch
        self._flush([r for r in reqs if len(self.pending.get(r, ())) >= (1 if small else FOLLOW_EVERY)])

    def _flush(self, reqs: list[Request]) -> None:
        """The MTP over the pending rows of `reqs` (positions upto.. with the tokens one ahead)."""
        runs, kept = [], []
        for r in reqs:
            rows = self.pending.pop(r, None)
            st = self.state.get(r)
            if rows and st is not None and r.finish is None:
                runs.append(
                    (r.row, r.tokens[st.upto + 1 : st.upto + 1 + len(rows)], torch.stack(rows), st.upto)
                )
                kept.append(r)
        self._extend(kept, runs)

    def _draft_kept(self, r: Request, positions: int) -> None:
        """The MTP's own positions are rewritten by the extend after each verify."""

    def after_prefill(self, group: list[Request], batch) -> None:
        """The MTP over each prefilled request's new positions (the target's hidden states of them)."""
        hidden, ends = self.s.decoder.hidden, batch.last_index[: len(group)].tolist()
        runs, kept, begin = [], [], 0
        for r, end in zip(group, ends, strict=True):
            start = int(batch.positions[begin])
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
            self.state[r] = _State(start + len(ids), logits[i], hidden[i])

    def _draft_greedy(self, mine: list[Request], k: int) -> tuple[dict, dict]:
        """`_draft` for greedy requests of k drafts each: the chain on the device, one read-back."""
        dev = self.s.table.device
        where = torch.tensor([[r.row for r in mine], [r.num_tokens - 1 for r in mine]]).to(
            dev, non_blocking=True
        )
        logits = torch.stack([self.state[r].logits for r in mine])
        hidden = torch.stack([self.state[r].hidden for r in mine])
        context = self.s._decode_context(max(r.num_tokens for r in mine) + k)
        run = self.chains.run if self.chains is not None else self.mtp.chain
        ids = run(where[0], where[1], logits, hidden, k - 1, self.s.table, context).tolist()
        return {id(r): d for r, d in zip(mine, ids, strict=True)}, {id(r): [] for r in mine}

    def _draft(self, mine: list[Request], ks: dict[int, int]):
        """d1 from each request's kept MTP logits, then d2.. from the MTP on its own hidden state, at
        positions N-1.. (slots the step allocated for them, their table entries written by `_prepare`)."""
        k = greedy_chain(mine, ks)
        if k:
            return self._draft_greedy(mine, k)
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
        at = 0
        for r in mine:
            n = ks[id(r)] + 1
            start = len(r.slots)
            self.s.table[r.row, start : start + n] = torch.tensor(
                fresh[at : at + n], device=self.s.table.device
            )
            at += n


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
    log.info("speculative decoding: NEXTN, the MTP layer of %s, %d draft tokens per verify",
             args.model, args.speculative_num_steps)  # fmt: skip
