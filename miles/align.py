"""Token-level alignment of the engine and the trainer (`miles align MODEL`).

The engine generates once; the engine and the trainer then score the same tokens. A rollout's
|Δ log p| = |log p_engine(token) - log p_trainer(token)| per generated token is what off-policy
corrections (TIS, masking) pay for, and its tail names the tokens where the two differ. Then, for
the sequence holding the worst token, both run one forward over it and their sublayer outputs are
compared module by module, in forward order:

    model.layers.i.input_layernorm, .self_attn, .post_attention_layernorm, .mlp, ..., model.norm

with rel(module) = max |engine - trainer| / max |trainer| over the positions that predict a scored
token (all but the last, which also has no replayed route). The first module whose rel exceeds the
tolerance is where the two implementations part (a difference upstream of it stays within the
tolerance, and everything downstream inherits it).

The trainer side of `--backend fsdp` is the FSDP trainer's own model builder (transformers' class,
`miles/train/fsdp/sharding.causal_lm`), unsharded; with routing replay (on by default for MoE models,
`--no-replay` off) its routers take the engine's experts as the trainer does under
`train.routing_replay=rollout`. `--backend megatron` is the Megatron trainer's GPTModel on one rank,
loaded from the HF weights as the backend loads them, its sublayers compared under Megatron's names
(`decoder.layers.i.self_attention`, `.pre_mlp_layernorm`, `.mlp`, `decoder.final_layernorm`); its
routers route on their own; for DeepSeek-V4 it is the model of Miles' Megatron modules
(miles/train/megatron/deepseek_v4_model.py, `MegatronV4Side`), whose sublayers carry transformers'
names. The engine side is the embedded engine's decoder on the same weights (its per-op forward). A
model a side cannot load is refused, naming the rooms that load it.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

DEFAULT_PROMPTS = (
    "what is the sum of 12 and 30? answer:",
    "reverse the word level, then count its letters.",
    "the next value of the sequence 2 4 6 8 is",
    "copy this list: 7 1 9 3 and sort it.",
)
MODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


@dataclass
class Scored:
    """One generated sequence, scored by both sides."""

    prompt: list[int]
    output: list[int]
    engine: list[float]
    trainer: list[float] = field(default_factory=list)
    routes: np.ndarray | None = None
    """[len(prompt + output) - 1, layers * k] the engine's experts (MoE with routing recorded)."""

    @property
    def delta(self) -> np.ndarray:
        return np.abs(np.asarray(self.engine) - np.asarray(self.trainer))


@dataclass
class Report:
    """What `miles align` prints."""

    sequences: list[Scored]
    modules: list[tuple[str, float]]
    """(module, rel) for the worst sequence, in forward order."""
    tolerance: float
    worst: list[tuple[int, int, int, float, float]] = field(default_factory=list)
    """(sequence, position in the output, token, engine log p, trainer log p), worst first."""

    @property
    def deltas(self) -> np.ndarray:
        return np.concatenate([s.delta for s in self.sequences])

    @property
    def first_divergent(self) -> str | None:
        return next((m for m, rel in self.modules if rel > self.tolerance), None)

    def summary(self) -> dict[str, Any]:
        d = self.deltas
        return {
            "tokens": int(d.size),
            "mean": float(d.mean()),
            "p99": float(np.percentile(d, 99)),
            "max": float(d.max()),
            "first_divergent_module": self.first_divergent,
        }


def read_prompts(path: str | None, tokenizer) -> list[list[int]]:
    """Token ids of the prompts: a file of JSON lines (`prompt` or `text`) or plain lines, or the
    built-in few. ValueError naming the file when it holds none."""
    if path is None:
        texts = list(DEFAULT_PROMPTS)
    else:
        texts = []
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = line
            texts.append(row.get("prompt") or row.get("text") or "" if isinstance(row, dict) else str(row))
        texts = [t for t in texts if t]
        if not texts:
            raise ValueError(
                f"{path} holds no prompt: write one per line (text, or JSON with a 'prompt' key)"
            )
    return [tokenizer(t)["input_ids"] or [tokenizer.eos_token_id] for t in texts]


def engine_generate(
    decoder, prompts: list[list[int]], max_new: int, temperature: float, seed: int
) -> list[Scored]:
    """The engine's continuations (sampled with `seed`), log-probs and, for MoE models, routes."""
    from miles.engine.sampling import SamplingParams
    from miles.engine.scheduler import Request, Scheduler

    moe = decoder.spec.moe is not None
    decoder.record_routing = moe
    sched = Scheduler(
        decoder, max(len(prompts), 1), sum(len(p) for p in prompts) + len(prompts) * max_new + 64
    )
    reqs = []
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=max_new, temperature=temperature, ignore_eos=True)
        req = Request(rid=str(i), prompt=list(prompt), params=sp, seed=seed + i, stop_ids=frozenset())
        req.return_routed_experts = moe
        reqs.append(req)
        sched.submit(req)
    sched.run_until_idle()
    out = []
    for r in reqs:
        n = len(r.prompt) + len(r.output) - 1
        routes = r.routed_experts.reshape(n, -1).numpy() if moe and r.routed_experts is not None else None
        out.append(Scored(list(r.prompt), list(r.output), list(r.logprobs), routes=routes))
    return out


class FsdpSide:
    """The FSDP trainer's model (unsharded: `miles/train/fsdp/sharding.causal_lm`), its routers
    patched for R3 when `replay`."""

    def __init__(self, path: str, dtype: torch.dtype, replay: bool, device: str = "cpu"):
        from miles.train.fsdp.sharding import causal_lm
        from miles.train.routing_replay import RoutingReplay

        self.model = causal_lm(path).to(device=device, dtype=dtype).eval()
        self.rr = RoutingReplay.install(self.model, replay) if replay else None
        self.device = device

    def close(self) -> None:
        """Nothing to release."""

    @torch.no_grad()
    def logits(self, seq: Scored) -> torch.Tensor:
        """fp32 logits [T, vocab] of the sequence's prompt and output."""
        ids = torch.tensor([seq.prompt + seq.output], device=self.device)
        with _replayed(self.rr, seq):
            return self.model(input_ids=ids, use_cache=False).logits[0].float()

    @torch.no_grad()
    def trace(self, seq: Scored, names: list[str]) -> dict[str, torch.Tensor]:
        """The outputs [T, hidden] of the modules `names` (transformers' names) over one sequence."""
        modules = dict(self.model.named_modules())
        return _hooked(
            modules, {n: n for n in names if n in modules}, lambda: self.logits(seq), batch_first=True
        )


MEGATRON_MODULES = {
    "input_layernorm": "input_layernorm",
    "self_attn": "self_attention",
    "post_attention_layernorm": "pre_mlp_layernorm",
    "mlp": "mlp",
}
"""transformers' sublayer names -> megatron-core's (local layer spec; with Transformer Engine the input
norm is fused into the QKV GEMM and has no output of its own)."""


class MegatronSide:
    """The Megatron trainer's GPTModel (miles/train/megatron/model.py) on one rank, loaded from the HF
    weights as the backend loads them; routers route on their own (no replay)."""

    def __init__(self, path: str, dtype: torch.dtype):
        from transformers import AutoConfig

        from miles.train.megatron import model as M

        self._one_rank()
        cfg = AutoConfig.from_pretrained(path)
        # without CUDA, MoE layers take megatron-core's all-gather dispatcher (its all-to-all one
        # opens a CUDA stream); one sequence at a time needs no variable lengths
        cpu = (
            {}
            if torch.cuda.is_available()
            else {"moe_token_dispatcher_type": "allgather", "variable_seq_lengths": False}
        )
        with _cpu_device():
            self.model = M.build_gpt(cfg, M.transformer_config(cfg, dtype, 1, 1, use_cpu=True, extra=cpu))
        M.load_hf_into(self.model, M.read_hf_state(path), cfg)
        self.model.eval()
        self.rr = None

    def _one_rank(self) -> None:
        """A private one-rank group (nothing leaves this process) unless one exists; gone at close()."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self._ours = not dist.is_initialized()
        if self._ours:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            ps.initialize_model_parallel(1, 1)

    def close(self) -> None:
        """Tear down the process group this side made, if it made one."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        if self._ours:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
            self._ours = False

    @torch.no_grad()
    def logits(self, seq: Scored) -> torch.Tensor:
        ids = torch.tensor([seq.prompt + seq.output])
        with _cpu_device():
            return self.model(ids, torch.arange(ids.shape[1])[None], None)[0].float()

    @torch.no_grad()
    def trace(self, seq: Scored, names: list[str]) -> dict[str, torch.Tensor]:
        modules = dict(self.model.named_modules())
        theirs = {}
        for name in names:
            parts = name.split(".")
            if name == "model.norm":
                theirs[name] = "decoder.final_layernorm"
            elif len(parts) == 4 and parts[3] in MEGATRON_MODULES:
                theirs[name] = f"decoder.layers.{parts[2]}.{MEGATRON_MODULES[parts[3]]}"
        theirs = {k: v for k, v in theirs.items() if v in modules}
        return _hooked(modules, theirs, lambda: self.logits(seq), batch_first=False)


class MegatronV4Side(MegatronSide):
    """DeepSeek-V4 of Miles' Megatron modules (miles/train/megatron/deepseek_v4_model.py) on one rank,
    loaded from the checkpoint by its conversion; its sublayers carry transformers' names."""

    def __init__(self, path: str, dtype: torch.dtype):
        from transformers import AutoConfig

        from miles.train.megatron import deepseek_v4_model as V4
        from miles.train.megatron.model import _moe_utils_without_te, read_hf_state

        self._one_rank()
        _moe_utils_without_te()
        cfg = AutoConfig.from_pretrained(path)
        cpu = {} if torch.cuda.is_available() else {"moe_token_dispatcher_type": "allgather"}
        with _cpu_device():
            tf = V4.transformer_config(cfg, dtype, use_cpu=True, extra={**cpu, "variable_seq_lengths": False})
            self.model = V4.DeepseekV4GPT(cfg, tf)
        V4.load(self.model, read_hf_state(path))
        self.model.eval()
        self.rr = None

    @torch.no_grad()
    def logits(self, seq: Scored) -> torch.Tensor:
        with _cpu_device():
            return self.model(torch.tensor([seq.prompt + seq.output]))[0].float()

    @torch.no_grad()
    def trace(self, seq: Scored, names: list[str]) -> dict[str, torch.Tensor]:
        modules = dict(self.model.named_modules())
        theirs = {n: "norm" if n == "model.norm" else n.removeprefix("model.") for n in names}
        theirs = {k: v for k, v in theirs.items() if v in modules}
        return _hooked(modules, theirs, lambda: self.logits(seq), batch_first=False)


@contextlib.contextmanager
def _cpu_device():
    """megatron-core's rotary table asks torch.cuda for its device; without CUDA it is told the CPU."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _hooked(modules: dict, names: dict[str, str], run, batch_first: bool) -> dict[str, torch.Tensor]:
    """Outputs of modules[names[k]] under key k while `run()` runs (first element of a tuple output,
    the one sequence of its batch)."""
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for ours, theirs in names.items():

        def keep(_m, _a, out, ours=ours):
            out = _primary(ours, out).detach().clone()  # later adds may be in place
            seen[ours] = out[0] if batch_first else out[:, 0]

        hooks.append(modules[theirs].register_forward_hook(keep))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def _primary(name: str, out) -> torch.Tensor:
    """The output a module is compared by: the first of a tuple, but a DeepSeek-V4 hyper-connection's
    (post, comb, collapsed) by its mixing weights [post; comb] (miles/engine/deepseek_v4.hyper_mixes)."""
    if name.endswith(("attn_hc", "ffn_hc")):
        from miles.engine.deepseek_v4 import hyper_mixes

        return hyper_mixes(out[0], out[1])
    return out[0] if isinstance(out, tuple) else out


def _replayed(rr, seq: Scored):
    """The routing context of one sequence for the patched routers (a no-op without replay)."""
    from miles.sample import Sample
    from miles.train.routing_replay import packed_routing

    if rr is None or seq.routes is None:
        return contextlib.nullcontext()
    sample = Sample(0, 0, seq.prompt, seq.output)
    sample.routed_experts = seq.routes
    return rr.batch(packed_routing([sample], [0], rr.shape, required=True), measure=False)


def trainer_score(side, seqs: list[Scored]) -> None:
    """Each sequence's generated tokens scored by the trainer side's forward (fp32 log-softmax)."""
    for s in seqs:
        lp = torch.log_softmax(side.logits(s), dim=-1)
        n = len(s.prompt)
        s.trainer = [lp[n - 1 + j, t].item() for j, t in enumerate(s.output)]


def _engine_trace(decoder, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The engine's sublayer outputs over one sequence (one prefill forward with tracing on)."""
    from miles.engine.spec import Batch

    n = len(tokens)
    ar = torch.arange(n, device=decoder.device)
    batch = Batch(ar.new_tensor(tokens), ar, ar + 1, ar[None], ar[None], (ar + 1)[None], ar)
    decoder.trace, decoder.record_routing = {}, False
    try:
        decoder.forward(batch, decoder.new_kv_pool(n + 1))
        return decoder.trace
    finally:
        decoder.trace = None


def compare_modules(decoder, side, seq: Scored) -> list[tuple[str, float]]:
    """(module, rel) in forward order over one sequence (module docstring)."""
    engine = _engine_trace(decoder, seq.prompt + seq.output)
    trainer = side.trace(seq, list(engine))
    out = []
    for name in engine:  # the last position predicts no scored token and has no replayed route
        if name not in trainer:
            continue
        a, b = engine[name][:-1].float(), trainer[name][:-1].float()
        rel = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
        out.append((name, rel))
    return out


def trainer_side(model_dir: str, backend: str, dtype: torch.dtype, replay: bool):
    """The trainer side of `backend` (fsdp or megatron); ValueError naming what loads the model."""
    import json as _json

    from miles.models.families import FAMILIES

    arch = (_json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [""])[0]
    if backend == "megatron" and arch == "DeepseekV4ForCausalLM":  # Megatron modules, not yet the backend
        return MegatronV4Side(model_dir, dtype)
    family = FAMILIES.get(arch)
    if family is not None:
        family.refuse_unless(backend)
    if backend == "megatron":
        return MegatronSide(model_dir, dtype)
    return FsdpSide(model_dir, dtype, replay)


DEFAULT_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
"""Module rel difference counted as divergent, by compute dtype (bf16's own rounding reads ~1e-2)."""


def align(
    model_dir: str,
    prompts: list[list[int]] | None = None,
    max_new: int = 32,
    dtype: torch.dtype = torch.float32,
    tolerance: float | None = None,
    replay: bool = True,
    temperature: float = 1.0,
    seed: int = 0,
    top: int = 5,
    patch=None,
    backend: str = "fsdp",
) -> Report:
    """Generate with the engine, score with both, compare modules (module docstring). `patch(decoder,
    model)` may change either side before scoring (tests plant a bug there)."""
    from transformers import AutoTokenizer

    from miles.engine.fp8_weights import plain_decoder
    from miles.engine.model import ModelSpec, load_weights

    if prompts is None:
        prompts = read_prompts(None, AutoTokenizer.from_pretrained(model_dir))
    spec = ModelSpec.from_dir(model_dir)
    side = trainer_side(model_dir, backend, dtype, replay and spec.moe is not None)
    try:
        decoder = plain_decoder(spec, load_weights(model_dir), "cpu", dtype)
        if patch is not None:
            patch(decoder, side.model)
        seqs = engine_generate(decoder, prompts, max_new, temperature, seed)
        trainer_score(side, seqs)
        worst_seq = max(range(len(seqs)), key=lambda i: seqs[i].delta.max())
        modules = compare_modules(decoder, side, seqs[worst_seq])
    finally:
        side.close()
    tol = DEFAULT_TOLERANCE.get(dtype, 1e-3) if tolerance is None else tolerance
    report = Report(seqs, modules, tol)
    pos = [(i, j) for i, s in enumerate(seqs) for j in range(len(s.output))]
    pos.sort(key=lambda ij: -seqs[ij[0]].delta[ij[1]])
    report.worst = [(i, j, seqs[i].output[j], seqs[i].engine[j], seqs[i].trainer[j]) for i, j in pos[:top]]
    return report


def render(report: Report, tokenizer=None) -> str:
    """The report as text: the |Δ log p| figures, the worst tokens, the modules up to the first
    divergent one (or all, when none is)."""
    s = report.summary()
    lines = [
        f"|delta log p| over {s['tokens']} generated tokens: mean {s['mean']:.3g}  p99 {s['p99']:.3g}  "
        f"max {s['max']:.3g}",
        "worst tokens (sequence, position, token, engine log p, trainer log p):",
    ]
    for i, j, tok, a, b in report.worst:
        text = repr(tokenizer.decode([tok])) if tokenizer is not None else ""
        lines.append(f"  seq {i} pos {j} token {tok} {text}  {a:.5f}  {b:.5f}  (|d| {abs(a - b):.3g})")
    first = report.first_divergent
    lines.append(
        f"modules of the worst sequence (rel = max|engine - trainer| / max|trainer|, tolerance "
        f"{report.tolerance:g}):"
    )
    for name, rel in report.modules:
        mark = "  <- first beyond tolerance" if name == first else ""
        lines.append(f"  {name:<44} {rel:.3g}{mark}")
        if name == first:
            break
    lines.append(f"first divergent module: {first}" if first else "no module beyond tolerance")
    return "\n".join(lines)


def main(args) -> int:
    """`miles align` (miles/cli.py)."""
    from transformers import AutoTokenizer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    tok = AutoTokenizer.from_pretrained(args.model)
    report = align(
        args.model,
        read_prompts(args.prompts, tok),
        args.max_new_tokens,
        dtype,
        args.tolerance,
        not args.no_replay,
        args.temperature,
        args.seed,
        backend=args.backend,
    )
    print(render(report, tok))
    if args.json:
        Path(args.json).write_text(json.dumps(report.summary(), indent=2) + "\n")
    return 0 if not math.isnan(report.summary()["max"]) else 1
