"""The Megatron-core train backend: GPTModel with tensor / pipeline / data parallelism.

Same five methods and metrics as the FSDP backend (see miles/train/backend.py); the RL objective is
miles/train/objective.py. Every rank is given the same full list of samples; the step is split into
`train.mini_batches_per_step` optimiser updates, each mini-batch is dealt round-robin over the
data-parallel ranks and cut into micro-batches that Megatron's pipeline schedule runs.

Gradient scaling. objective.py returns per micro-batch a partial sum whose total over the whole
mini-batch is the loss L (global aggregation weights). Megatron's schedule divides each micro-batch
loss by the number of micro-batches and its DDP averages gradients over the DP ranks, so the loss
handed to it is multiplied by both: the resulting gradient is exactly dL/dtheta.

Precision: bf16 parameters inside Megatron's Float16Module, fp32 gradient reduction and fp32 master
weights in the distributed optimizer (Adam). Needs CUDA: megatron-core's forward allocates on the
current CUDA device and uses the CUDA RNG tracker.

KL to a frozen reference (`train.loss.kl_coef > 0`), as in the FSDP backend: a second GPTModel of the
same layout, loaded from model.path and never updated, stays on the GPU beside the policy (FSDP keeps
its sharded reference on the device too; offload() moves both to host memory). Before the step's first
update each rank runs no-grad passes over its own micro-batches, the ones its updates train on: the
reference's log-probs, and the old policy's with `train.loss.old_logprobs = recompute`; the shared objective
(miles/train/objective.py) adds the KL estimator's term and reports `kl` and `kl_loss`.

Optimizer offload (`train.optimizer_offload = cpu`): megatron-core's own HybridDeviceOptimizer holds
the whole distributed-optimizer shard on the CPU (fp32 master weights and Adam moments in host memory,
torch's fused CPU AdamW updates them, the bf16 parameters are copied back). With `nvme` the same
optimizer (one CPU AdamW per shard) keeps that state in files under train.offload_dir between steps
and streams it shard by shard (miles/train/megatron/nvme.py); checkpoints read it back whole while
they run. Activation recompute (`train.recompute`) maps to megatron-core's
selective (core attention) or full (every layer) recompute. Micro-batches are packed rows without
padding (miles/train/megatron/batch.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.config import ConfigError
from miles.config.layout import check_layout
from miles.sample import Sample
from miles.train import step
from miles.train.losses.aggregate import normalizers
from miles.train.megatron import architectures, checkpoint, memory
from miles.train.megatron import batch as B
from miles.train.megatron import model as M
from miles.train.megatron.moe import MoERouting
from miles.train.megatron.mtp import lm_weights, sink_then_head
from miles.train.optim import lr_factor


def require_megatron() -> None:
    """Raise ConfigError (naming the key to change) when this machine cannot run the backend."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "train.backend=megatron needs CUDA GPUs (megatron-core's forward is CUDA-only) and none is "
            "visible here: set train.backend=fsdp to train on CPU, or run on a GPU node"
        )
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise ConfigError(
            "train.backend=megatron needs megatron-core: `pip install megatron-core` on the trainer "
            "nodes, or set train.backend=fsdp"
        ) from None


def recompute_config(mode: str) -> dict[str, Any]:
    """TransformerConfig fields of train.recompute: megatron-core's selective recompute of core
    attention, or its full recompute of every decoder layer (uniform method, one layer per unit)."""
    if mode == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def offload_config(mode: str) -> dict[str, Any]:
    """OptimizerConfig fields of train.optimizer_offload=cpu|nvme: megatron-core's HybridDeviceOptimizer
    with the whole distributed-optimizer shard on the CPU. megatron-core runs it on its precision-aware
    path (the hybrid optimizer makes and keeps the fp32 master copies of the bf16 shards; fp32 gradients
    reach it as `decoupled_grad`), which needs no Transformer Engine when offloading. For nvme it builds
    one CPU AdamW per shard (`overlap_cpu_optimizer_d2h_h2d`), the unit streamed through disk."""
    if mode not in ("cpu", "nvme"):
        return {}
    return {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": 1.0,
        "use_precision_aware_optimizer": True,
        **({"overlap_cpu_optimizer_d2h_h2d": True} if mode == "nvme" else {}),
    }


class MegatronBackend:
    """TrainBackend on megatron-core (see the module docstring)."""

    plan: Any
    hf_cfg: Any
    arch: architectures.Architecture
    """What is built for the model's architecture (miles/train/megatron/architectures.py)."""
    model: Any
    """Megatron DDP wrapper around (Float16Module around) this rank's GPTModel stage."""
    optimizer: Any
    ref_model: Any
    """Frozen reference policy (kl_coef > 0): this rank's GPTModel stage (inside Float16Module in bf16)."""
    step_count: int
    offloader: memory.StorageOffloader | None
    moe: MoERouting | None
    """Routing replay and router metrics of an MoE model (miles/train/megatron/moe.py); None: dense."""
    critic: Any
    """PPO's critic (train.loss.advantage = ppo; miles/train/megatron/critic.py), else None."""
    packed: bool
    """Micro-batches as packed rows (train.micro_batch_layout, resolved on this node)."""
    _forward_kwargs: dict[str, Any]

    def __init__(self) -> None:
        self.plan = self.hf_cfg = self.arch = self.model = self.optimizer = None
        self.step_count = 0
        self.offloader = None
        self.ref_model = None
        self.critic = None
        self.moe = None
        self.packed = True
        self._forward_kwargs = {}
        self.hidden_sink = None
        """fn(the micro-batch as one row, its final-normed hidden states [b, s, h]) called in each update
        forward (the MTP layer's training, miles/train/mtp_training.py), or None."""

    # ---------------------------------------------------------------- setup
    def setup(self, plan: Any) -> None:
        """Process groups, model (from plan.model.path), DDP wrapper and distributed optimizer."""
        require_megatron()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from transformers import AutoConfig

        from miles.cluster.distributed import init_distributed

        t = plan.train
        try:
            self.packed = B.packed_layout(t.micro_batch_layout)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        init_distributed("cuda", float(getattr(t, "collective_timeout_s", 600)))
        # every layout, feature and model-split rule (miles/config/layout.py), with this world size
        check_layout(plan, dist.get_world_size(), "the trainer's world size")
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                t.tensor_parallel, t.pipeline_parallel, expert_model_parallel_size=t.expert_parallel
            )
        model_parallel_cuda_manual_seed(plan.run.seed)
        self.plan, self.hf_cfg = plan, AutoConfig.from_pretrained(plan.model.path)
        self.arch = architectures.of(self.hf_cfg)
        if (why := architectures.refusal(self.arch, t)) is not None:
            raise ConfigError(why)
        self.packed = self.packed and self.arch.packs(self.hf_cfg)  # e.g. latent attention: whole rows
        self.model, self.optimizer = self._build()

    def _build(self):
        from miles.train.losses import get_estimator
        from miles.train.megatron.optim import schedule_hooks, wrap_for_training

        t = self.plan.train
        dtype = torch.bfloat16 if self.plan.model.dtype == "bfloat16" else torch.float32
        split = (t.pipeline_first_stage_layers, t.pipeline_last_stage_layers)
        tf = self.arch.config(
            self.hf_cfg,
            dtype,
            t.tensor_parallel,
            t.pipeline_parallel,
            ep=t.expert_parallel,
            stage_layers=split,
            extra=recompute_config(t.recompute),
        )
        gpt = self.arch.build(self.hf_cfg, tf)
        gpt.cuda(torch.cuda.current_device())
        hf_state = M.read_hf_state(self.plan.model.path)
        self.arch.load(gpt, hf_state, self.hf_cfg)
        if t.lora is not None:  # frozen base, adapters on the dense projections (lora.py)
            from miles.train.megatron import lora

            lora.install(gpt, t.lora, self.hf_cfg, self.plan.run.seed)
        replay = t.routing_replay == "rollout"
        offset = self.arch.layer_offset(gpt)
        self.moe = MoERouting(gpt, self.hf_cfg, offset, replay) if tf.num_moe_experts else None
        self._install_fake_quant(gpt)
        # bf16 logits stay bf16 (Float16Module would upcast them: twice the vocabulary-sized bytes
        # each way); the fused log-prob kernel reads them as they are and computes in fp32
        self._forward_kwargs = {"fp32_output": False} if dtype == torch.bfloat16 else {}
        ddp, optimizer = wrap_for_training(tf, gpt, dtype, t, t.lr, offload_config(t.optimizer_offload))
        if t.optimizer_offload == "nvme":
            from miles.train.megatron import nvme

            nvme.stream_optimizer(optimizer, t.offload_dir, t.offload_require_local, dist.get_rank())
        if t.loss.kl_coef > 0:  # before the hooks below: an MoE layer deep-copies the config it is built with
            self.ref_model = self._reference(tf, hf_state, dtype)
        if get_estimator(t.loss.advantage).critic:
            from miles.train.megatron.critic import Critic

            fields = {
                "tp": t.tensor_parallel,
                "pp": t.pipeline_parallel,
                "ep": t.expert_parallel,
                "stage_layers": split,
                "extra": recompute_config(t.recompute),
            }
            self.critic = Critic(
                self.plan, self.hf_cfg, fields, offload_config(t.optimizer_offload), self._forward_kwargs
            )
        schedule_hooks(tf, ddp, optimizer)
        return ddp, optimizer

    def _reference(self, tf: Any, hf_state: dict[str, Tensor], dtype: torch.dtype) -> torch.nn.Module:
        """The frozen reference policy: the policy's architecture, layout and fake-quant forward with the
        weights of model.path, no gradients. It shares the policy's TransformerConfig: a forward-only
        schedule reads nothing there that training changes."""
        from megatron.core.transformer.module import Float16Module

        gpt = self.arch.build(self.hf_cfg, tf)
        gpt.cuda(torch.cuda.current_device())
        self.arch.load(gpt, hf_state, self.hf_cfg)
        if self.moe is not None:  # the reference forward replays the rollout's experts too
            self.moe.attach(gpt, self.arch.layer_offset(gpt), measured=False)
        self._install_fake_quant(gpt)
        gpt.requires_grad_(False)
        return Float16Module(tf, gpt) if dtype == torch.bfloat16 else gpt

    def _install_fake_quant(self, gpt: torch.nn.Module) -> None:
        """train.quantization=fake_quant: covered linears forward with the FP8 contract's values
        (miles/train/megatron/quant.py); nothing otherwise."""
        from megatron.core import parallel_state as ps

        from miles.train.megatron import quant as MQ
        from miles.train.quant import fake_quant_layout

        contract = fake_quant_layout(self.plan)
        if contract is None:
            return
        MQ.install_fake_quant(
            gpt,
            contract,
            M.shapes_of(self.hf_cfg),
            M.layer_offset(gpt),
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group(),
        )

    @property
    def temperature(self) -> float:
        """The engine samples from softmax(z / T) and reports those log-probs; the trainer matches it."""
        return float(self.plan.rollout.temperature) or 1.0

    @property
    def gpt(self):
        """This rank's GPTModel stage (unwrapped)."""
        m = self.model.module
        return m.module if hasattr(m, "module") else m

    # ---------------------------------------------------------------- train
    def train(self, samples: list[Sample]) -> dict[str, float]:
        """One step (miles.train.step's recipe): mini_batches_per_step optimiser updates over `samples`
        (the same list on every rank), each data-parallel rank packing its share of each mini-batch."""
        from megatron.core import parallel_state as ps

        from miles.train.batching import check_samples

        check_samples(samples)
        start = time.perf_counter()
        recompute = self.plan.train.loss.old_logprobs == "recompute"
        adv = step.advantages(samples, self.plan)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if self.moe is not None:  # router metrics: each sample's policy forward once
            self.moe.reset()
        parts = []
        for ids in step.mini_batches(len(samples), self.plan, dp):
            mine_ids = ids[dp_rank::dp]
            mine = [samples[i] for i in mine_ids]
            parts.append(([samples[i] for i in ids], mine, self._pack(mine, [adv[i] for i in mine_ids])))
        critic_steps = None if self.critic is None else self.critic.steps
        critic_metrics = {} if self.critic is None else self._train_critic(parts)
        stats, updates = step.StepStats(), []
        lr = self.plan.train.lr * lr_factor(self.step_count, self.plan.train)
        if step.policy_trains(critic_steps, self.plan):
            updates = self._policy_updates(parts, stats, recompute)
        stats.reduce(_all_reduce_sum)
        tokens, seqs = normalizers([s.loss_mask for s in samples])
        metrics = stats.metrics(
            len(updates), int(tokens), int(seqs), distill=self.plan.train.distill is not None
        )
        metrics.update(
            grad_norm=step.mean(n for n, _ in updates),
            update_skipped=step.mean(float(skipped) for _, skipped in updates),
            lr=lr,
            **critic_metrics,
        )
        if self.moe is not None:
            metrics.update(self.moe.metrics())
        metrics["step_time_s"] = time.perf_counter() - start
        return metrics

    def _policy_updates(self, parts, stats: step.StepStats, recompute: bool) -> list[tuple[float, bool]]:
        """Every mini-batch's old and reference log-probs before the first update changes the policy,
        then one update per mini-batch; (grad norm, skipped) of each. The engine/trainer mismatch is
        measured on the recomputed old log-probs, or else on the first update's forward."""
        if self.moe is not None:
            self.moe.measure = recompute
        pre = [self._pre_forward(mine, mbs, recompute) for _, mine, mbs in parts]
        if recompute:
            for (_, mine, _), (old, _) in zip(parts, pre, strict=True):
                _add_mismatch(stats, mine, old)
        out = []
        for k, ((mini, mine, mbs), (old, ref)) in enumerate(zip(parts, pre, strict=True)):
            measure = k == 0 and not recompute
            if self.moe is not None:
                self.moe.measure = measure
            out.append(self._update(mini, mine, mbs, old, ref, stats, measure))
        return out

    def _train_critic(
        self, parts: list[tuple[list[Sample], list[Sample], list[B.MicroBatch]]]
    ) -> dict[str, float]:
        """The critic's values before any update, GAE advantages (written into the policy's micro-batches)
        and returns, then one critic update per mini-batch; returns the critic/* metrics."""
        from miles.train.losses.value import CRITIC_STATS, add_target_stats, critic_metrics, ppo_targets

        critic, cfg = self.critic, self.plan.train.critic
        old = {
            (k, j): v
            for k, (_, mine, mbs) in enumerate(parts)
            for j, v in enumerate(critic.values(mine, mbs))
        }
        masks = {
            (k, j): torch.tensor(s.loss_mask, dtype=torch.float32)
            for k, (_, mine, _) in enumerate(parts)
            for j, s in enumerate(mine)
        }
        rewards = {
            (k, j): float(s.reward) for k, (_, mine, _) in enumerate(parts) for j, s in enumerate(mine)
        }
        adv, returns = ppo_targets(
            old, masks, rewards, cfg.gamma, cfg.lam, cfg.normalize_advantages, critic.all_reduce
        )
        stats = torch.zeros(CRITIC_STATS, dtype=torch.float64)
        for key in old:
            add_target_stats(stats, old[key], returns[key], masks[key])
        lr = critic.lr * lr_factor(critic.steps, self.plan.train)
        warmup = critic.steps < cfg.warmup_steps
        norms = []
        for k, (mini, mine, mbs) in enumerate(parts):
            for mb in mbs:
                if mb.sample_ids:
                    mb.advantages = torch.cat([adv[(k, i)] for i in mb.sample_ids]).to(mb.advantages.device)
            n = len(mine)
            norms.append(
                critic.update(
                    mini, mbs, [old[(k, j)] for j in range(n)], [returns[(k, j)] for j in range(n)], stats
                )
            )
        critic.steps += 1
        return critic_metrics(critic.all_reduce(stats), len(parts), norms, lr, warmup)

    def _routes(self, samples: list[Sample], mb: B.MicroBatch):
        """Context of one micro-batch forward: the rollout's experts for an MoE model (routing replay)."""
        return contextlib.nullcontext() if self.moe is None else self.moe.micro_batch(samples, mb)

    def _pack(self, samples: list[Sample], adv: list[float]) -> list[B.MicroBatch]:
        """This rank's micro-batches of `samples`; with expert parallelism padded to the count of the
        data-parallel rank that has the most (collective over that group)."""
        dev = torch.device("cuda", torch.cuda.current_device())
        mbs = B.pack(samples, adv, self.plan.train.max_tokens_per_microbatch, dev, self.packed)
        return mbs if self.moe is None else self.moe.pad_micro_batches(mbs)

    def _update(self, mini, mine, mbs, old, ref, stats: step.StepStats, measure: bool) -> tuple[float, bool]:
        """One optimiser update over a mini-batch (`mini`: all of it; `mine`: this DP rank's part, packed
        as `mbs`; `old` / `ref`: its old-policy and reference log-probs, indexed as `mine`, or None);
        its objective sums go into `stats` (with the mismatch when `measure`). (grad norm, skipped)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t = self.plan.train
        for g in self.optimizer.param_groups:
            g["lr"] = t.lr * lr_factor(self.step_count, t)
        norm = normalizers([s.loss_mask for s in mini], [float(s.weight) for s in mini])
        scale = len(mbs) * ps.get_data_parallel_world_size()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=partial(
                self._forward_step, norm=norm, scale=scale, old=old, ref=ref, samples=mine, measure=measure
            ),
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=max(m.tokens.shape[1] for m in mbs),
            micro_batch_size=max(m.tokens.shape[0] for m in mbs),
            forward_only=False,
        )
        ok, grad_norm, _ = self.optimizer.step()
        self.step_count += 1
        _add_outputs(stats, out)
        return float(grad_norm or 0.0), not ok

    def _forward_step(self, data_iterator, model, norm, scale, old, ref, samples, measure):
        mb = next(data_iterator)
        with self._routes(samples, mb):
            out = model(
                mb.tokens,
                mb.positions,
                None,
                packed_seq_params=M.packed_seq_params(mb),
                **self._forward_kwargs,
                output_processor=partial(B.response_head, mb=mb)
                if self.hidden_sink is None
                else partial(sink_then_head, self.hidden_sink, mb),
            )
        return out, partial(self._loss, mb, norm, scale, old, ref, measure)

    def _loss(self, mb: B.MicroBatch, norm, scale, old, ref, measure, logits):
        from miles.train.distill import topk_logprobs
        from miles.train.losses import get_estimator, token_weights
        from miles.train.objective import TokenBatch, policy_objective

        cfg = self.plan.train.loss
        logp, entropy = B.response_logprobs(logits, mb, self.temperature, with_entropy=True)
        if old is None:
            old_logp = mb.rollout_logp
        else:
            old_logp = torch.cat([old[i] for i in mb.sample_ids]).to(logp.device)
        n = len(mb.sample_ids)
        w = token_weights(mb.mask, mb.seq_index, n, cfg.aggregation, norm[0], norm[1], mb.seq_weight)
        ref_logp = None if ref is None else torch.cat([ref[i] for i in mb.sample_ids]).to(logp.device)
        tb = TokenBatch(
            logp,
            old_logp,
            mb.rollout_logp,
            mb.advantages,
            mb.mask,
            w,
            mb.seq_index,
            n,
            ref_logp=ref_logp,
            entropy=entropy,
            teacher_logp=mb.teacher_logp,
            student_topk_logp=None
            if mb.teacher_topk_ids is None
            else topk_logprobs(
                logits,
                torch.arange(logits.shape[0], device=logits.device),
                mb.teacher_topk_ids,
                self.temperature,
            ),
            teacher_topk_logp=mb.teacher_topk_logp,
        )
        distill = self.plan.train.distill
        coef = distill.coef if distill else 0.0
        loss, sums = policy_objective(tb, cfg, get_estimator(cfg.advantage).sequence_ratio, coef)
        zero = mb.mask.new_zeros((), dtype=torch.float32)
        sums["mismatch_sum"] = (mb.mask * (logp.detach() - mb.rollout_logp).abs()).sum() if measure else zero
        sums["mismatch_tokens"] = mb.mask.sum().float() if measure else zero
        return loss * scale, sums

    def _pre_forward(self, samples: list[Sample], mbs: list[B.MicroBatch], recompute: bool):
        """(old-policy, reference) log-probs of this rank's `samples`, packed as `mbs`: the policy's
        when old_logprobs=recompute and the reference's when kl_coef > 0 (None otherwise), over the same
        micro-batches as the update."""
        old = self._logprobs(samples, mbs, self.model) if recompute else None
        ref = None if self.ref_model is None else self._logprobs(samples, mbs, self.ref_model)
        return old, ref

    @torch.no_grad()
    def _logprobs(self, samples: list[Sample], mbs: list[B.MicroBatch], model: Any) -> list[Tensor | None]:
        """Log-probs of each of `samples`' responses (packed as `mbs`) under `model`, in `samples`' order;
        on the last pipeline stage only (None elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        found: list[Tensor | None] = [None] * len(samples)

        def collect(mb, logits):
            logp, _ = B.response_logprobs(logits, mb, self.temperature)
            for i, part in zip(
                mb.sample_ids, logp.split([samples[i].response_length for i in mb.sample_ids]), strict=True
            ):
                found[i] = part
            return logits.sum() * 0, {}

        def step(it, model):
            mb = next(it)
            head = partial(B.response_head, mb=mb)
            with self._routes(samples, mb):
                out = model(
                    mb.tokens,
                    mb.positions,
                    None,
                    packed_seq_params=M.packed_seq_params(mb),
                    **self._forward_kwargs,
                    output_processor=head,
                )
            return out, partial(collect, mb)

        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iter(mbs),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=max(m.tokens.shape[1] for m in mbs),
            micro_batch_size=max(m.tokens.shape[0] for m in mbs),
            forward_only=True,
        )
        return found

    # ------------------------------------------------------- weights, state
    def mtp_source(self) -> tuple[Any, Callable[[], tuple[Tensor, Tensor]]]:
        """The HF config, and the embedding and LM head whole on every rank (miles/train/megatron/mtp.py)."""
        return self.hf_cfg, partial(lm_weights, self.gpt, self.hf_cfg.vocab_size)

    def export_weights(self, bucket_bytes: int):
        """HF-named full tensors in buckets of at most bucket_bytes; rank 0 gets them, others empty lists.
        With a quantised engine (engine.quantization), covered weights leave in its layout.

        Collective: every rank must iterate to the end.
        """
        from miles.quant.formats import engine_contract
        from miles.weights.bucket import iter_buckets

        if self.plan.train.lora is not None:  # the adapter alone, under PEFT's saved names
            from miles.train.megatron import lora

            named = lora.adapter_tensors(self.gpt, self.plan.train.lora.name, M.shapes_of(self.hf_cfg))
            for bucket in iter_buckets(named, bucket_bytes):  # collective over pipeline stages
                yield bucket if dist.get_rank() == 0 else []
            return
        contract = engine_contract(self.plan)
        for bucket in self.arch.export(self.gpt, self.hf_cfg, bucket_bytes, contract):
            yield bucket if dist.get_rank() == 0 else []

    def save(self, step: int, extra: dict[str, Any] | None = None) -> str:
        with self._optimizer_resident(write_back=False):
            return checkpoint.save(self, step, extra)

    def load(self, step: int | None = None) -> dict[str, Any]:
        with self._optimizer_resident(write_back=True):
            return checkpoint.load(self, step)

    def _optimizer_resident(self, write_back: bool):
        """train.optimizer_offload=nvme: the streamed optimizer state in host memory while a checkpoint
        reads or fills it (miles/train/megatron/nvme.py); nothing otherwise."""
        if self.plan.train.optimizer_offload != "nvme":
            return contextlib.nullcontext()
        from miles.train.megatron import nvme

        return nvme.resident(self.optimizer, write_back)

    def offload(self) -> None:
        """Move parameters, gradient buffers, optimiser state on the GPU and the reference model's
        parameters to pinned host memory."""
        # Rebuilt each time: Adam's state appears only at the first step.
        self.offloader = memory.StorageOffloader(memory.training_tensors(self))
        self.offloader.offload()

    def onload(self) -> None:
        if self.offloader is not None:
            self.offloader.onload()


def _all_reduce_sum(x: Tensor) -> Tensor:
    """Sum of `x` over every rank of the job (each rank has added only what it alone holds)."""
    y = x.to("cuda")
    dist.all_reduce(y)
    return y.cpu()


def _add_outputs(stats: step.StepStats, outputs: list[dict[str, Tensor]]) -> None:
    """Add an update's micro-batch sums (present on the last pipeline stage; counted once per
    data-parallel rank, by its tensor-parallel rank 0)."""
    from megatron.core import parallel_state as ps

    if not outputs or not (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0):
        return
    stats.add({k: torch.stack([o[k] for o in outputs]).sum() for k in outputs[0]})  # one transfer


def _add_mismatch(stats: step.StepStats, samples: list[Sample], old: list[Tensor | None]) -> None:
    """The recomputed old log-probs' mismatch with the rollout's (last pipeline stage, TP rank 0)."""
    from megatron.core import parallel_state as ps

    held = [(s, logp) for s, logp in zip(samples, old, strict=True) if logp is not None]
    if not held or ps.get_tensor_model_parallel_rank() != 0:
        return
    rollout = torch.tensor([x for s, _ in held for x in s.rollout_logprobs], dtype=torch.float32)
    mask = torch.tensor([m for s, _ in held for m in s.loss_mask], dtype=torch.float32)
    stats.add_mismatch(torch.cat([logp for _, logp in held]), rollout, mask)  # the mini-batch at once
