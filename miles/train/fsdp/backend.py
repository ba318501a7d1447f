"""FSDP2 train backend: `fully_shard` over a Hugging Face causal LM, driven by the RL objective.

Every decoder layer and then the root module are wrapped with `fully_shard`, sharding parameters,
gradients and optimiser state over all ranks of the default process group (gloo on CPU, NCCL on
GPU; miles/cluster/distributed.py). With `model.dtype = bfloat16` the forward/backward runs in bf16
while FSDP keeps fp32 master weights and reduces gradients in fp32 (MixedPrecisionPolicy), so AdamW
updates fp32 parameters.

One `train(samples)` step: advantages from the whole batch's groups; the batch is cut into
`train.mini_batches_per_step` mini-batches (one optimiser update each); each mini-batch is sharded
over ranks and packed into micro-batches (miles/train/batching.py); gradients accumulate over
micro-batches, are clipped to `train.grad_clip`, then AdamW steps; the LR schedule steps once per
training step. Losses use global normalisers and are scaled by the world size because FSDP averages
gradients over ranks, so N ranks compute the same update as one.

Before any update, one no-grad pass computes the old-policy log-probs (`train.loss.old_logprobs =
recompute`) and the frozen reference policy's log-probs (`kl_coef > 0`). The train/rollout
mismatch metric is measured on log-probs computed before the step's first update (that pass, or
else the first mini-batch's forward).

Mixture-of-experts models (transformers' Qwen3MoeForCausalLM) train as they are: the stacked expert
tensors are parameters of their decoder layer's FSDP unit, sharded like any other. Their routers are
patched once (miles/train/routing_replay.py): with `train.routing_replay = rollout` every forward
(old-policy, reference and training passes) uses the rollout's expert choice, and each step reports
router agreement, per-expert load, its imbalance and the load-balancing loss.

Low precision (miles/train/quant.py): `train.quantization = fake_quant` makes the linear layers the
FP8 contract covers forward with the contract's fake-quantised weight (the full weight FSDP gathered,
in model.dtype; straight-through gradient), applied before sharding and invisible to names, state
dicts and checkpoints; `torchao_float8` converts linears to torchao float8 training (CUDA). With an
FP8 engine `export_weights` ships covered weights as the contract's (float8, scale_inv) pairs.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from miles.cluster.distributed import init_distributed
from miles.config import ConfigError, Plan
from miles.models.families import packs_sequences
from miles.quant.formats import engine_contract
from miles.sample import Sample
from miles.train import quant, step
from miles.train.batching import Packed, RankPlan, check_samples, pack, plan_rank, response_logprobs
from miles.train.distill import topk_logprobs
from miles.train.fsdp import checkpoint, true_on_policy
from miles.train.fsdp.critic import Critic
from miles.train.fsdp.sharding import load_sharded
from miles.train.fsdp.weights import iter_full_tensors
from miles.train.losses import get_estimator, token_weights
from miles.train.losses.value import CRITIC_STATS, add_target_stats, critic_metrics, ppo_targets, value_loss
from miles.train.objective import TokenBatch, policy_objective
from miles.train.optim import build_optimizer, build_scheduler
from miles.train.routing_replay import RoutingReplay, packed_routing
from miles.weights.bucket import iter_buckets

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device_type(name: str) -> str:
    """`train.device` -> "cpu" or "cuda" ("auto": CUDA when a GPU is visible)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; set train.device=cpu or auto")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return "cpu"
    return "cuda"


class FSDPBackend:
    """TrainBackend over FSDP2 (see miles/train/backend.py for the contract)."""

    plan: Plan
    device: torch.device
    model: nn.Module
    ref_model: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rank: int
    world_size: int
    step: int
    _offloaded: bool
    _moved: list[tuple[dict[str, Any], str]]
    routing: RoutingReplay | None
    """The policy's patched routers (None: a dense model)."""
    _ref_routing: RoutingReplay | None
    _samples: list[Sample]
    critic: Critic | None
    """PPO's value model (train.loss.advantage = ppo), else None."""
    adapters: Any
    """train.lora.adapters: the adapters' own optimisers and schedules (lora.AdapterSet), else None."""

    def __init__(self) -> None:
        self.ref_model = None
        self.critic = self.adapters = None
        self.routing = self._ref_routing = None
        self._samples = []
        self.step = 0
        self._offloaded = False
        self._moved = []
        self.hidden_sink = None
        """fn(packed, final-normed hidden states) called after each update micro-batch's forward (the
        MTP layer's training, miles/train/mtp_training.py), or None."""

    def setup(self, plan: Plan) -> None:
        """Process group, sharded policy (and reference), optimiser and LR schedule."""
        t = plan.train
        self.plan = plan
        device_type = pick_device_type(t.device)
        init_distributed(device_type, t.collective_timeout_s)  # also selects this rank's GPU
        self.device = torch.device(
            device_type, torch.cuda.current_device() if device_type == "cuda" else None
        )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(plan.run.seed)
        self.estimator = get_estimator(t.loss.advantage)
        dtype = _DTYPES[plan.model.dtype]
        prepare = self._quantization(plan)
        adapters: dict[str, Any] = {}
        if t.lora is not None:  # the causal LM wrapped by PEFT, only the adapters trainable
            from miles.lora.adapters import freeze_base
            from miles.train.fsdp.lora import build

            adapters = {"build": build(t.lora), "freeze": freeze_base}
        self.model = load_sharded(
            plan.model.path, self.device, dtype, trainable=True, prepare=prepare, **adapters
        )
        if t.loss.kl_coef > 0:
            self.ref_model = load_sharded(
                plan.model.path, self.device, dtype, trainable=False, prepare=prepare
            )
        if t.true_on_policy:  # the engine's batch-invariant computation (true_on_policy.py)
            try:
                for model in filter(None, (self.model, self.ref_model)):
                    true_on_policy.install(model)
            except ValueError as e:
                raise ConfigError(f"{e} ({plan.model.path}): set train.true_on_policy=false") from None
        self._budget = t.max_tokens_per_microbatch
        """Tokens per micro-batch."""
        self._rows = not packs_sequences(self.model.config.model_type)
        """A family whose forward mixes a packed row (Family.packs False): micro-batches of sequences of
        one length, stacked as rows (batching.bins_of_equal_length)."""
        replay = t.routing_replay == "rollout"
        self.routing = RoutingReplay.install(self.model, replay)
        if self.ref_model is not None:
            self._ref_routing = RoutingReplay.install(self.ref_model, replay)
        if replay and self.routing is None:
            raise ConfigError(
                f"train.routing_replay=rollout but model {plan.model.path} has no mixture-of-experts "
                "router to replay; set train.routing_replay=off"
            )
        if t.lora is not None and t.lora.adapters:  # several adapters: an optimiser and schedule each
            from miles.train.fsdp.lora import AdapterSet

            self.adapters = AdapterSet(self.model, t.lora, t, self.rank)
            first = t.lora.names[0]
            self.optimizer, self.scheduler = self.adapters.optimizers[first], self.adapters.schedulers[first]
        else:
            trained = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapter only
            self.optimizer = build_optimizer(trained, t, rank=self.rank)
            self.scheduler = build_scheduler(self.optimizer, t)
        if self.estimator.critic:
            self.critic = Critic(plan, self.device, dtype, self.rank)

    def _quantization(self, plan: Plan) -> Callable[[nn.Module], Any] | None:
        """What train.quantization does to a freshly loaded model (None: nothing)."""
        mode = plan.train.quantization
        if mode in ("fake_quant", "int4_qat"):
            layout = quant.fake_quant_layout(plan)
            return lambda model: quant.install_fake_quant(model, layout)
        if mode == "torchao_float8":
            return lambda model: quant.install_torchao_float8(model, self.device)
        return None

    # ---- training -------------------------------------------------------------------------------

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """One training step over `samples` (the same full list on every rank)."""
        if self._offloaded:
            raise RuntimeError("train() while offloaded: call onload() first")
        if not samples:
            raise ValueError("train() needs at least one sample")
        metrics = self._train(samples) if self.adapters is None else self._train_adapters(samples)
        self.step += 1
        return metrics

    def _train_adapters(self, samples: list[Sample]) -> dict[str, float]:
        """train.lora.adapters: each adapter's samples train it alone (it is the active adapter, its
        optimiser steps, its gradients are clipped alone); metrics per adapter (`<name>/<key>`) and,
        unprefixed, their means over the adapters trained."""
        from miles.lora.adapters import activate

        per: dict[str, dict[str, float]] = {}
        for name, part in self.adapters.split(samples).items():
            self.optimizer, self.scheduler = self.adapters.optimizers[name], self.adapters.schedulers[name]
            if not part:  # no prompt of its task finished in time: its schedule keeps the run's step
                with warnings.catch_warnings():  # (torch warns of a schedule step with no optimiser step)
                    warnings.simplefilter("ignore", UserWarning)
                    self.scheduler.step()
                continue
            activate(self.model, name)
            self.model.zero_grad(set_to_none=True)  # no other adapter's gradient enters its clip
            per[name] = self._train(part)
        out = {f"{n}/{k}": v for n, m in per.items() for k, v in m.items()}
        for key in {k for m in per.values() for k in m}:
            values = [m[key] for m in per.values() if key in m]
            out[key] = sum(values) / len(values)
        return out

    def _train(self, samples: list[Sample]) -> dict[str, float]:
        """One step over `samples` with the current optimiser and LR schedule (miles.train.step's
        recipe); its metrics."""
        start = time.perf_counter()
        check_samples(samples)
        self._samples = samples
        if self.routing is not None:
            self.routing.reset()
        t = self.plan.train
        adv: dict[int, Any] = dict(enumerate(step.advantages(samples, self.plan)))
        plans = [
            plan_rank(samples, ids, self.rank, self.world_size, self._budget, self._rows)
            for ids in step.mini_batches(len(samples), self.plan)
        ]
        lr = float(self.optimizer.param_groups[0]["lr"])
        stats = step.StepStats()
        critic_metrics: dict[str, float] = {}
        if self.critic is not None:
            critic_metrics, adv = self._train_critic(samples, plans)
        grad_norms = []
        if step.policy_trains(None if self.critic is None else self.step, self.plan):
            old, ref = self._pre_forward(samples, plans, stats)
            for k, rank_plan in enumerate(plans):
                measure = k == 0 and t.loss.old_logprobs != "recompute"
                grad_norms.append(self._update(samples, rank_plan, adv, old, ref, stats, measure))
            self.scheduler.step()
        stats.reduce(self._all_reduce)
        tokens, seqs = sum(p.total_tokens for p in plans), sum(p.total_seqs for p in plans)
        metrics = stats.metrics(len(plans), tokens, seqs, distill=t.distill is not None)
        metrics.update(
            grad_norm=step.mean(grad_norms),
            lr=lr,
            reward_mean=float(sum(s.reward for s in samples) / len(samples)),
            step_time_s=time.perf_counter() - start,
            **critic_metrics,
        )
        if self.routing is not None:
            metrics.update(self.routing.metrics(self._all_reduce(self.routing.stats())))
        self._samples = []
        return metrics

    # ---- the critic (train.loss.advantage = ppo) ----------------------------------------------------

    def _train_critic(
        self, samples: list[Sample], plans: list[RankPlan]
    ) -> tuple[dict[str, float], dict[int, Any]]:
        """The critic's values before any update, GAE advantages and returns from them (losses/value.py),
        then one critic update per mini-batch. Returns the critic/* metrics and the per-token
        advantages of this rank's samples."""
        critic, cfg = self.critic, self.plan.train.critic
        assert critic is not None
        old: dict[int, Tensor] = {}
        masks: dict[int, Tensor] = {}
        with torch.no_grad():
            for rank_plan in plans:
                for real, packed in self._micro_batches(samples, rank_plan):
                    values = critic.values(packed)
                    if real:
                        old.update({i: v.cpu() for i, v in _split(values, packed).items()})
                        masks.update(_split(packed.mask, packed))
        rewards = {i: float(samples[i].reward) for i in old}
        adv, returns = ppo_targets(
            old, masks, rewards, cfg.gamma, cfg.lam, cfg.normalize_advantages, self._all_reduce
        )
        stats = torch.zeros(CRITIC_STATS, dtype=torch.float64)
        for i in old:
            add_target_stats(stats, old[i], returns[i], masks[i])
        lr = float(critic.optimizer.param_groups[0]["lr"])
        norms = [self._critic_update(samples, rank_plan, old, returns, stats) for rank_plan in plans]
        critic.scheduler.step()
        stats = self._all_reduce(stats)
        metrics = critic_metrics(stats, len(plans), norms, lr, self.step < cfg.warmup_steps)
        return metrics, adv

    def _critic_update(
        self,
        samples: list[Sample],
        rank_plan: RankPlan,
        old: dict[int, Tensor],
        returns: dict[int, Tensor],
        stats: Tensor,
    ) -> float:
        """Accumulate the clipped value loss over this rank's micro-batches, clip, step the critic."""
        critic, t = self.critic, self.plan.train
        assert critic is not None
        d = self.device
        critic.optimizer.zero_grad(set_to_none=True)
        for k, (real, packed) in enumerate(self._micro_batches(samples, rank_plan)):
            critic.model.set_requires_gradient_sync(k == rank_plan.n_micro - 1)
            values = critic.values(packed)
            if not real:
                (values.sum() * 0.0).backward()  # keeps this rank in step with the others
                continue
            idx = packed.samples
            mask, seq_index = packed.mask.to(d), packed.seq_index.to(d)
            per_token, clipped = value_loss(
                values,
                torch.cat([old[i] for i in idx]).to(d),
                torch.cat([returns[i] for i in idx]).to(d),
                t.critic.value_clip,
            )
            weights = token_weights(
                mask,
                seq_index,
                len(idx),
                t.loss.aggregation,
                rank_plan.loss_tokens,
                rank_plan.loss_seqs,
                packed.seq_weight,
            )
            loss = (weights * per_token).sum()
            (loss * self.world_size).backward()
            stats[0] += float(loss.detach())
            stats[1] += float((mask * clipped).sum())
        norm = torch.nn.utils.clip_grad_norm_(
            critic.model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf")
        )
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        critic.optimizer.step()
        return float(norm)

    def _all_reduce(self, x: Tensor) -> Tensor:
        """Sum of `x` over the trainer ranks (on the host)."""
        y = x.to(self.device)
        dist.all_reduce(y)
        return y.cpu()

    def _forward(
        self, model: nn.Module, packed: Packed, with_entropy: bool = False, measure: bool = False
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Response-token log-probs (and entropies) of `packed` under `model`, and with `with_entropy`
        (a training pass) the log-probs of the teacher's top-k tokens when the samples carry them;
        `measure` adds the pass to the step's router metrics."""
        rr = self.routing if model is self.model else self._ref_routing
        ctx = contextlib.nullcontext()
        if rr is not None:
            routing = packed_routing(self._samples, packed.samples, rr.shape, required=rr.replay)
            ctx = rr.batch(routing, measure)
        ids, pos = packed.rows() if self._rows else (packed.input_ids, packed.position_ids)
        sink = self.hidden_sink if with_entropy and model is self.model else None
        captured: list[Tensor] = []
        hook = (
            self.model.model.norm.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
            if sink
            else None
        )
        with ctx:
            out = model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), use_cache=False)
        if hook is not None:
            hook.remove()
            sink(packed, captured[-1])
        logits = out.logits.reshape(-1, out.logits.shape[-1])  # rows flattened: the packed order
        dev = Packed(
            **{k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in vars(packed).items()}
        )
        temperature = self.plan.rollout.temperature
        if self.plan.train.true_on_policy:  # the engine's log-softmax, bit for bit
            logp = true_on_policy.logprobs(logits, dev.logit_index, dev.targets, temperature)
            entropy = response_logprobs(logits, dev, temperature, True)[1] if with_entropy else None
        else:
            logp, entropy = response_logprobs(logits, dev, temperature, with_entropy)
        topk = None
        if with_entropy and dev.teacher_topk_ids is not None:
            topk = topk_logprobs(logits, dev.logit_index, dev.teacher_topk_ids, temperature)
        return logp, entropy, topk

    def _micro_batches(self, samples: list[Sample], rank_plan: RankPlan) -> Iterator[tuple[bool, Packed]]:
        """This rank's packed micro-batches, padded with throw-away ones up to the ranks' maximum."""
        for k in range(rank_plan.n_micro):
            real = k < len(rank_plan.micro_batches)
            yield real, pack(samples, rank_plan.micro_batches[k] if real else [0])

    @torch.no_grad()
    def _pre_forward(
        self, samples: list[Sample], plans: list[RankPlan], stats: step.StepStats
    ) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        """Per-sample old-policy (recompute) and reference log-probs, before any update."""
        recompute = self.plan.train.loss.old_logprobs == "recompute"
        old: dict[int, Tensor] = {}
        ref: dict[int, Tensor] = {}
        if not recompute and self.ref_model is None:
            return old, ref
        for rank_plan in plans:
            for real, packed in self._micro_batches(samples, rank_plan):
                if recompute:
                    logp, *_ = self._forward(self.model, packed)
                    if real:
                        old.update(_split(logp, packed))
                        stats.add_mismatch(logp, packed.rollout_logp, packed.mask)
                if self.ref_model is not None:
                    ref_logp, *_ = self._forward(self.ref_model, packed)
                    if real:
                        ref.update(_split(ref_logp, packed))
        return old, ref

    def _update(
        self,
        samples: list[Sample],
        rank_plan: RankPlan,
        adv: dict[int, Any],
        old: dict[int, Tensor],
        ref: dict[int, Tensor],
        stats: step.StepStats,
        measure_mismatch: bool,
    ) -> float:
        """Accumulate gradients over this rank's micro-batches, clip, and take one optimiser step."""
        cfg = self.plan.train
        self.optimizer.zero_grad(set_to_none=True)
        for k, (real, packed) in enumerate(self._micro_batches(samples, rank_plan)):
            self.model.set_requires_gradient_sync(k == rank_plan.n_micro - 1)
            logp, entropy, topk = self._forward(self.model, packed, with_entropy=real, measure=real)
            if not real:
                # a pass that only keeps this rank in step with the others' collectives
                (logp.sum() * 0.0).backward()
                continue
            tb = self._token_batch(packed, logp, entropy, topk, adv, old, ref, rank_plan)
            coef = cfg.distill.coef if cfg.distill else 0.0
            loss, sums = policy_objective(tb, cfg.loss, self.estimator.sequence_ratio, coef)
            # FSDP averages gradients over ranks; the global weights already normalise the loss
            (loss * self.world_size).backward()
            stats.add(sums)
            if measure_mismatch:
                stats.add_mismatch(logp, packed.rollout_logp, packed.mask)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        return float(norm)

    def _token_batch(
        self,
        packed: Packed,
        logp: Tensor,
        entropy: Tensor,
        student_topk: Tensor | None,
        adv: dict[int, Any],
        old: dict[int, Tensor],
        ref: dict[int, Tensor],
        rank_plan: RankPlan,
    ) -> TokenBatch:
        d = self.device
        idx = packed.samples
        lengths = torch.bincount(packed.seq_index, minlength=len(idx))
        rollout = packed.rollout_logp.to(d)
        mask = packed.mask.to(d)
        seq_index = packed.seq_index.to(d)
        mode = self.plan.train.loss.aggregation
        return TokenBatch(
            logp=logp,
            old_logp=torch.cat([old[i] for i in idx]) if old else rollout,
            rollout_logp=rollout,
            advantages=torch.cat(
                [_per_token(adv[i], int(n)) for i, n in zip(idx, lengths.tolist(), strict=True)]
            ).to(d),
            mask=mask,
            weights=token_weights(
                mask, seq_index, len(idx), mode, rank_plan.loss_tokens, rank_plan.loss_seqs, packed.seq_weight
            ),
            seq_index=seq_index,
            n_seqs=len(idx),
            ref_logp=torch.cat([ref[i] for i in idx]) if ref else None,
            entropy=entropy,
            teacher_logp=None if packed.teacher_logp is None else packed.teacher_logp.to(d),
            student_topk_logp=student_topk,
            teacher_topk_logp=None if packed.teacher_topk_logp is None else packed.teacher_topk_logp.to(d),
        )

    # ---- weights, checkpoints, memory -----------------------------------------------------------

    def mtp_source(self) -> tuple[Any, Callable[[], tuple[Tensor, Tensor]]]:
        """The policy's HF config and a function giving its embedding and LM head whole on every rank
        (FSDP2 shards gathered: a collective), for the MTP layer's training (miles/train/mtp_training.py)."""
        from miles.train.mtp_training import full_tensor

        model = self.model
        return model.config, lambda: (full_tensor(model.get_input_embeddings().weight),
                                      full_tensor(model.get_output_embeddings().weight))  # fmt: skip

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
        """Full HF-named tensors in `plan.model.dtype`, on the trainer device, in bounded buckets.

        With a quantised engine (engine.quantization), each weight its contract covers leaves in the
        engine's layout (the FP8 pair `X.weight` + `X.weight_scale_inv`, or a packed format's parts),
        quantised from the model.dtype tensor (the values a fake-quant forward computes with)."""
        dtype = _DTYPES[self.plan.model.dtype]
        if self.plan.train.lora is not None:  # the adapters alone, as <adapter>/<PEFT's saved name>
            from miles.lora.adapters import adapter_tensors

            return iter_buckets(adapter_tensors(self.model, dtype), bucket_bytes, keep=self.rank == 0)
        named = quant.export_pairs(iter_full_tensors(self.model, dtype), engine_contract(self.plan))
        return iter_buckets(named, bucket_bytes, keep=self.rank == 0)

    def save(self, step: int, extra: dict[str, Any] | None = None) -> str:
        """Checkpoint the full training state under <run_dir>/checkpoints/step_<step>/."""
        ckpt = self.plan.train.checkpoint
        critic = self.critic.parts() if self.critic is not None else None
        optimizer, scheduler = self._training_state()
        out = checkpoint.save_checkpoint(
            self.plan.run_dir, step, self.model, optimizer, scheduler, extra, ckpt.keep_last, critic
        )
        return str(out)

    def _training_state(self) -> tuple[Any, Any]:
        """The optimiser(s) and LR schedule(s) a checkpoint holds."""
        return (self.optimizer, self.scheduler) if self.adapters is None else self.adapters.state()

    def load(self, step: int | None = None) -> dict[str, Any]:
        """Restore a checkpoint (None: the latest complete one); returns the caller's `extra`."""
        critic = self.critic.parts() if self.critic is not None else None
        optimizer, scheduler = self._training_state()
        self.step, extra = checkpoint.load_checkpoint(
            self.plan.run_dir, step, self.model, optimizer, scheduler, critic
        )
        return extra

    def export_hf(self, out_dir: str | Path) -> Path:
        """Write an inference-ready Hugging Face directory of the current weights (rank 0 writes)."""
        return checkpoint.export_hf(self.model, self.plan.model.path, out_dir, _DTYPES[self.plan.model.dtype])

    def offload(self) -> None:
        """Move weights, gradients and optimiser state to host memory (no-op on CPU)."""
        if self._offloaded:
            raise RuntimeError("offload() called twice; every offload() needs an onload()")
        self._offloaded = True
        self._move(torch.device("cpu"))

    def onload(self) -> None:
        """Bring back what offload() moved to host memory."""
        if not self._offloaded:
            raise RuntimeError("onload() without a preceding offload()")
        self._offloaded = False
        self._move(self.device)

    def _move(self, target: torch.device) -> None:
        if self.device.type == "cpu":
            return
        critic = self.critic
        for model in (self.model, self.ref_model, critic.model if critic else None):
            if model is not None:
                model.to(target)
        # only state that lived on the accelerator moves; an offloading optimiser keeps its own
        if target.type == "cpu":
            own = [self.optimizer] if self.adapters is None else list(self.adapters.optimizers.values())
            optimizers = own + ([critic.optimizer] if critic else [])
            self._moved = [
                (state, key)
                for optimizer in optimizers
                for state in optimizer.state.values()
                for key, value in state.items()
                if isinstance(value, Tensor) and value.device.type != "cpu"
            ]
        for state, key in self._moved:
            state[key] = state[key].to(target)
        if target.type == "cpu":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _per_token(advantage: float | Tensor, n: int) -> Tensor:
    """A sample's advantage on each of its n response tokens (a per-token tensor stays as it is)."""
    if isinstance(advantage, Tensor):
        return advantage.float()
    return torch.full((n,), float(advantage))


def _split(logp: Tensor, packed: Packed) -> dict[int, Tensor]:
    """Per-sample pieces of a packed micro-batch's response log-probs."""
    lengths = torch.bincount(packed.seq_index, minlength=len(packed.samples)).tolist()
    return dict(zip(packed.samples, logp.detach().split(lengths), strict=True))
