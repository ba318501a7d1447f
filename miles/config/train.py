"""How the policy is trained: backend, parallelism, optimiser, objective, checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from miles.config.base import ConfigError, Section
from miles.config.rollout import TaskConfig

if TYPE_CHECKING:
    from miles.config.plan import Plan


class LossConfig(Section):
    """The RL objective (see miles/train/losses/)."""

    advantage: Literal["grpo", "reinforce_pp", "gspo", "ppo"] = "grpo"
    """Advantage estimator: critic-free from group structure (grpo, reinforce_pp, gspo), or `ppo`:
    per-token GAE from a learned value function (train.critic)."""
    normalize_std: bool = True
    """GRPO: divide group-centred rewards by the group std."""
    eps_clip: float = 0.2
    """PPO clip lower epsilon."""
    eps_clip_high: float | None = None
    """PPO clip upper epsilon (clip-higher); default: eps_clip."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 for negative advantages; None: off."""
    aggregation: Literal["token", "sequence"] = "token"
    """Token-level mean over the batch, or mean of per-sequence means."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of KL to the frozen reference policy (0: no reference model is kept)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_in_reward: bool = False
    """Apply KL as a per-token reward penalty instead of a loss term."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight."""
    tis: Literal["off", "truncate", "mask"] = "off"
    """Train/rollout mismatch correction: truncated importance weights, or masking tokens out of band."""
    tis_clip: float = Field(2.0, gt=1.0)
    """Upper bound of the TIS weight (mask: the band is [1/tis_clip, tis_clip])."""
    old_logprobs: Literal["recompute", "rollout"] = "rollout"
    """Old-policy log-probs: recomputed by the trainer before the update, or taken from the rollout."""


class DistillConfig(Section):
    """On-policy distillation (miles/train/distill.py): a teacher scores the student's own sampled
    tokens and its per-token log-probs shift the advantage."""

    teacher_urls: list[str] = []
    """SGLang-protocol servers serving the teacher (its tokenizer must be the student's)."""
    teacher_model: str | None = None
    """Or a local HF model directory: Miles starts an embedded engine for it (local runs)."""
    coef: float = Field(1.0, ge=0.0)
    """Weight of the shift: A_t += -coef * (log p_student(t) - log p_teacher(t))."""
    mode: Literal["logprob", "topk_reverse_kl"] = "logprob"
    """How the teacher teaches (miles/train/distill.py): `logprob` shifts each sampled token's
    advantage by the log-prob gap; `topk_reverse_kl` adds coef x the reverse KL over the teacher's
    top_k tokens at each position (plus one bucket for the rest) to the loss, a dense term with a gradient
    of its own."""
    top_k: int = Field(20, ge=1, le=1024)
    """topk_reverse_kl: how many of the teacher's likeliest tokens each position carries."""
    teacher_key: str | None = None
    """Prompt metadata key whose value (an index into teacher_urls) picks each sample's teacher; None:
    samples are spread over the teachers in turn."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The default targets; `lm_head` may be added (an adapter on the output projection)."""


_ADAPTER_NAME = r"^[A-Za-z0-9_-]+$"


class LoraAdapterConfig(Section):
    """One adapter of a several-adapter run (train.lora.adapters)."""

    name: str = Field(pattern=_ADAPTER_NAME)
    """Its name in the engines (the `lora_path` of its requests) and in checkpoints and exports."""
    task: TaskConfig
    """Where its prompts come from (rollout.task's schema); every adapter shares rollout.reward, which
    can tell them apart by `sample.metadata["lora_path"]`."""


class LoraConfig(Section):
    """LoRA training (docs/lora.md): the base weights stay frozen, only the adapters' A and B train
    (and only they have optimiser state); each weight push sends only the adapter, which the engines
    serve unmerged under `name` (every rollout request names it as its `lora_path`)."""

    rank: int = Field(16, ge=1)
    alpha: float = Field(32.0, gt=0.0)
    """Scaling alpha / rank of the low-rank term."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[
        Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    ] = list(LORA_TARGETS)
    """Linear layers that get an adapter (dense attention and MLP projections, and the LM head)."""
    name: str = Field("policy", pattern=_ADAPTER_NAME)
    """The adapter's name in the engines."""
    adapters: list[LoraAdapterConfig] = []
    """Several adapters trained in one job, each on its own task with its own optimiser and LR
    schedule, all served by the same engines under their own names (empty: one adapter, `name`, on
    rollout.task). rank, alpha, dropout and target_modules are shared."""

    @property
    def names(self) -> list[str]:
        """The adapters this run trains, in order."""
        return [a.name for a in self.adapters] or [self.name]


class CriticConfig(Section):
    """The value function of PPO (train.loss.advantage = ppo; miles/train/critic.py): the policy's
    architecture with a scalar value head, trained beside the policy on the same ranks."""

    path: str | None = None
    """Model directory the critic's body starts from (None: model.path); its value head starts at 0."""
    lr: float | None = Field(None, ge=0.0)
    """Peak learning rate of the critic (None: train.lr); same schedule shape as the policy's."""
    warmup_steps: int = Field(0, ge=0)
    """Critic-only steps at the start: the critic trains, the policy (and its LR schedule) waits."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """Clip of the new value around the old one in the value loss (None: unclipped)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount of GAE, per policy token."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda (1: Monte-Carlo returns minus the value; 0: one-step TD errors)."""
    normalize_advantages: bool = True
    """Whiten the GAE advantages over the step's trained tokens (mean 0, std 1)."""


class DraftConfig(Section):
    """The speculative draft trained with the policy: every step, one optimiser step of its
    cross-entropy on the rollout's own trained tokens, and every weight push carries it to the
    engines' draft. engine.speculative STANDALONE: the draft model of draft_model_path
    (miles/train/draft_model.py); NEXTN: the model's MTP layer on the policy's hidden states
    (miles/train/mtp_training.py; FSDP, or Megatron with pipeline_parallel 1)."""

    lr: float = Field(1e-3, gt=0.0)
    """AdamW learning rate of the draft."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient-norm clip of the draft's step."""
    max_tokens_per_microbatch: int = Field(8192, ge=1)
    """Tokens per packed micro-batch of the draft's step (STANDALONE; NEXTN uses the policy's)."""


class CheckpointConfig(Section):
    """Checkpointing of the full training state (file sizes and SHA-256 recorded, checked on resume)."""

    every_steps: int = Field(50, ge=0)
    """Save every N steps and at the end (0: only at the end); a crash loses at most N steps."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept (>= 2 leaves one to resume from if the newest is damaged)."""


class TrainConfig(Section):
    """The trainer."""

    backend: Literal["fsdp", "megatron"] = "fsdp"
    """Training backend (same interface; see miles/train/__init__.py)."""
    num_ranks: int = 1
    """Trainer processes (local runs; on Slurm the actor group decides)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Trainer device; `auto` picks cuda when available."""
    steps: int = 20
    """Training steps in the run."""
    lr: float = Field(1e-3, ge=0.0)
    """Peak learning rate."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """LR shape after warmup, from `lr` down to `min_lr` at `steps`."""
    min_lr: float = Field(0.0, ge=0.0)
    """Final learning rate of the linear / cosine decay."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0.0)
    """Max global grad norm (0: off)."""
    max_tokens_per_microbatch: int = Field(8192, ge=1)
    """Token budget of one micro-batch per rank (sequences are packed up to it)."""
    micro_batch_layout: Literal["auto", "packed", "padded"] = "auto"
    """Megatron micro-batch rows: `packed` (sequences back to back in one row, attention by a
    variable-length kernel over their offsets), `padded` (one right-padded sequence per row), `auto`
    (padded where Transformer Engine's attention is installed, which takes no offsets here; else
    packed). FSDP always packs."""
    mini_batches_per_step: int = Field(1, ge=1)
    """Optimiser updates per step (PPO epochs over mini-batches)."""
    collective_timeout_s: int = Field(600, ge=1)
    """Timeout of every collective of the trainer's process group."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute in the backward pass (Megatron): `selective` recomputes each layer's core
    attention, `full` every decoder layer from its input (least memory, about one more forward per
    step). train.backend=fsdp refuses anything but none."""
    context_parallel: int = 1
    """Context-parallel size: each sequence split over this many ranks, which divide the trainer ranks
    with tensor_parallel x pipeline_parallel (rules in miles/config/layout.py). Neither backend builds
    it yet: both refuse > 1."""
    optimizer_offload: Literal["none", "cpu", "nvme"] = "none"
    """Where optimiser state lives (see miles/train/offload/)."""
    offload_dir: str | None = None
    """NVMe offload directory on node-local disk (one sub-directory per rank)."""
    offload_bucket_mb: int = 256
    """Bucket size of streamed optimiser state in MiB."""
    offload_moment_dtype: Literal["fp32", "bf16"] = "fp32"
    """Storage dtype of offloaded Adam moments (fp32: bit-exact AdamW; bf16: half the bytes)."""
    offload_require_local: bool = True
    """Refuse an offload_dir on a network filesystem (NFS, Lustre, GPFS, ...)."""
    loss: LossConfig = LossConfig()
    lora: LoraConfig | None = None
    """LoRA training instead of full-parameter training (None: off)."""
    critic: CriticConfig = CriticConfig()
    """The value function, trained only with train.loss.advantage = ppo."""
    distill: DistillConfig | None = None
    """On-policy distillation from a teacher (None: off)."""
    draft: DraftConfig | None = None
    """Train the speculative draft model with the policy (DraftConfig); None: the draft stays frozen."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    tensor_parallel: int = 1
    """Megatron: tensor-parallel size (train.backend=fsdp refuses > 1; rules in miles/config/layout.py)."""
    pipeline_parallel: int = 1
    """Megatron: pipeline-parallel size, layers split evenly over the stages unless the first / last
    stage sizes below are set (fsdp refuses > 1)."""
    pipeline_first_stage_layers: int | None = Field(None, ge=1)
    """Megatron, pipeline_parallel > 1: decoder layers of the first stage (it also holds the embedding);
    the layers left are split evenly over the other stages. None: the even split."""
    pipeline_last_stage_layers: int | None = Field(None, ge=1)
    """Megatron, pipeline_parallel > 1: decoder layers of the last stage (it also holds the LM head and
    the loss). None: the even split."""
    expert_parallel: int = 1
    """Expert-parallel size of MoE layers (divides the experts and the data-parallel ranks; rules in
    miles/config/layout.py): Megatron gives each expert-parallel rank its share of the experts. FSDP
    shards experts like every other parameter and refuses > 1."""
    routing_replay: Literal["off", "rollout"] = "off"
    """MoE routing replay: `rollout` (R3) makes the trainer's forward use the rollout engine's expert
    choice per token and layer (router probabilities gathered there and renormalised, so the router
    still learns); `off` lets the trainer's router choose (miles/train/routing_replay.py)."""
    true_on_policy: bool = False
    """The engine's sampled-token log-probs and the trainer's recomputed ones equal bit for bit: the
    engines run deterministic inference (SGLang's `--enable-deterministic-inference --rl-on-policy-target
    fsdp`; the embedded engine's batch-invariant forward) and the FSDP trainer's forward calls the same
    batch-invariant operations (miles/quant/invariant.py), whatever the batch, chunking or cached prefix.
    With `rollout.schedule: sync` (rollout and training on the same weights) train/logprob_mismatch is
    then 0 (with Qwen3-MoE and routing replay as well). FSDP only; Qwen2 / Qwen3 / Llama / Qwen3-MoE
    models in full precision (no LoRA, no quantisation, no speculative decoding); slower engines and
    trainer (bench/RESULTS.md)."""
    quantization: Literal["none", "fake_quant", "int4_qat", "torchao_float8"] = "none"
    """Low precision in the trainer's forward (miles/train/quant.py). `fake_quant`: the linear layers
    the FP8 contract covers (miles/quant/fp8.py) compute with the contract's quantise -> dequantise of
    their weight in model.dtype (straight-through gradient), so the trainer sees exactly the weights an
    FP8 engine serves; the layout is engine.quantization's, which must then be fp8_block or fp8_row.
    `torchao_float8` (CUDA only, the `torchao` extra): real FP8 training GEMMs for speed, with their
    own dynamic scales; it does not make the trainer agree with the engine and is not combined with
    fake_quant. `int4_qat`: fake_quant against an `int4` engine (upstream's name for INT4
    quantisation-aware training); fake_quant also serves `mxfp8` and `nvfp4` engines (emulated). `none`:
    the forward runs in model.dtype (with a quantised engine: low-precision rollout whose mismatch only
    TIS/MIS correct)."""


def check_true_on_policy(plan: Plan) -> None:
    """What train.true_on_policy needs (ConfigError naming the key to change)."""
    t, e = plan.train, plan.engine
    if not t.true_on_policy:
        return
    if t.backend != "fsdp":
        raise ConfigError(
            "train.true_on_policy=true makes the FSDP trainer's forward the engine's computation; the "
            "Megatron backend's is not (its measured mismatch: bench/RESULTS.md): set train.backend=fsdp"
        )
    clashes = {
        "train.lora": t.lora is not None,
        "train.quantization": t.quantization != "none",
        "engine.quantization": e.quantization != "none",
        "engine.speculative": e.speculative is not None,
    }
    for key, clash in clashes.items():
        if clash:
            raise ConfigError(
                f"train.true_on_policy=true covers full-precision dense models alone: unset {key}"
            )


def check_draft(plan: Plan) -> None:
    """What train.draft needs (ConfigError naming the key to change)."""
    if plan.train.draft is None:
        return
    spec, e = plan.engine.speculative, plan.engine
    nextn = spec is not None and spec.algorithm == "NEXTN"
    if not nextn and (spec is None or spec.algorithm != "STANDALONE" or not spec.draft_model_path):
        raise ConfigError(
            "train.draft trains the speculative draft: set engine.speculative.algorithm=STANDALONE with "
            "engine.speculative.draft_model_path, or NEXTN (the model's MTP layer)"
        )
    if nextn and plan.train.backend == "megatron" and plan.train.pipeline_parallel > 1:
        raise ConfigError(
            "train.draft with engine.speculative.algorithm=NEXTN trains the MTP layer on the policy's "
            "hidden states and LM head, which pipeline stages hold apart: set train.pipeline_parallel=1, "
            "train.backend=fsdp, or a STANDALONE draft"
        )
    if e.kind != "embedded" or e.urls:
        raise ConfigError(
            "train.draft pushes the draft's weights as draft.* tensors, which only the embedded engine "
            "started by Miles loads: set engine.kind=embedded without engine.urls, or unset train.draft"
        )
    if plan.train.lora is not None:
        raise ConfigError(
            "train.draft pushes full weights; a LoRA run pushes its adapters: unset one of them"
        )


def check_lora(plan: Plan) -> None:
    """What train.lora is built for (ConfigError naming the key to change)."""
    if plan.train.lora is None:
        return
    if plan.train.backend == "megatron":
        _check_megatron_lora(plan)
    if plan.train.quantization != "none" or plan.engine.quantization != "none":
        raise ConfigError(
            "train.lora runs on bf16/fp32 weights: set train.quantization=none and engine.quantization=none"
        )
    if plan.train.loss.advantage == "ppo":
        raise ConfigError(
            "train.lora does not train a critic: use train.loss.advantage=grpo (or another critic-free one)"
        )
    if plan.weights.transport == "disk":
        raise ConfigError(
            "train.lora pushes adapters through /load_lora_adapter_from_tensors: set weights.transport=distributed or tensor"
        )
    if plan.eval.every_steps and plan.eval.mode != "shared":
        raise ConfigError(
            f"train.lora evaluates the adapters on the rollout engines: set eval.mode=shared (got "
            f"{plan.eval.mode}), or eval.every_steps=0"
        )
    adapters = plan.train.lora.adapters
    if not adapters:
        return
    names = [a.name for a in adapters]
    if len(set(names)) != len(names):
        raise ConfigError(f"train.lora.adapters: names must differ (got {', '.join(names)})")
    r = plan.rollout
    if r.generate_fn or r.agent_fn:
        raise ConfigError(
            "train.lora.adapters trains single-request rollouts; remove rollout.generate_fn / rollout.agent_fn "
            "or train one adapter (train.lora without adapters)"
        )
    if plan.train.optimizer_offload != "none":
        raise ConfigError("train.lora.adapters keeps one AdamW per adapter: set train.optimizer_offload=none")


def _check_megatron_lora(plan: Plan) -> None:
    """What Megatron LoRA (miles/train/megatron/lora.py) is built for."""
    t, lora = plan.train, plan.train.lora
    assert lora is not None
    if t.expert_parallel != 1:
        raise ConfigError(
            "train.lora with train.backend=megatron adapts dense layers only: set train.expert_parallel=1, "
            "or train.backend=fsdp"
        )
    if lora.dropout > 0:
        raise ConfigError(
            "train.lora.dropout must be 0 with train.backend=megatron (or use train.backend=fsdp)"
        )
    if "lm_head" in lora.target_modules:
        raise ConfigError(
            "train.lora.target_modules: lm_head is adapted by train.backend=fsdp only; remove it or switch backend"
        )
    if lora.adapters:
        raise ConfigError("train.lora.adapters (several adapters) runs with train.backend=fsdp")


def check_distill(plan: Plan) -> None:
    """train.distill names exactly one teacher source (ConfigError naming the keys)."""
    d = plan.train.distill
    if d is None:
        return
    if bool(d.teacher_urls) == bool(d.teacher_model):
        raise ConfigError(
            "train.distill needs exactly one of train.distill.teacher_urls (running servers) and "
            "train.distill.teacher_model (a model directory Miles serves)"
        )


def check_quantization(plan: Plan) -> None:
    """Cross-section rules of train.quantization (ConfigError naming both keys)."""
    mode = plan.train.quantization
    engine = plan.engine.quantization
    if mode == "fake_quant" and engine == "none":
        raise ConfigError(
            "train.quantization=fake_quant reproduces the quantised weights of the engine, but "
            "engine.quantization=none serves bf16 ones: set engine.quantization=fp8_block (or fp8_row, "
            "int4, mxfp8, nvfp4), or train.quantization=none"
        )
    if mode == "int4_qat" and engine != "int4":
        raise ConfigError(
            f"train.quantization=int4_qat trains against an int4 engine, but engine.quantization={engine}: "
            "set engine.quantization=int4 (or train.quantization=fake_quant for the engine's format)"
        )
    if mode == "torchao_float8":
        if plan.train.device == "cpu":
            raise ConfigError(
                "train.quantization=torchao_float8 runs FP8 GEMMs on CUDA GPUs only, and train.device=cpu: "
                "set train.quantization=none (or fake_quant with an FP8 engine.quantization)"
            )
        if plan.train.backend != "fsdp":
            raise ConfigError(
                f"train.quantization=torchao_float8 is built for train.backend=fsdp only (got "
                f"{plan.train.backend}); set train.quantization=fake_quant or none"
            )
