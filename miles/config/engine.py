"""Settings of the rollout engines: which engine, how many, how big, or the URLs of running ones."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal
from urllib.parse import urlparse

from pydantic import Field, field_validator

from miles.config.base import ConfigError, Section

if TYPE_CHECKING:
    from miles.config.plan import Plan


class SpeculativeConfig(Section):
    """Speculative decoding during rollout, in SGLang's terms (its `--speculative-*` flags, which both
    the embedded engine and SGLang servers get from these keys). The embedded engine runs STANDALONE
    (a separate draft model) and NEXTN (the model's own MTP layer, miles/engine/mtp.py): the draft
    proposes `num_steps` tokens, one target forward verifies them, and speculative sampling keeps the
    target's distribution and log-probs (miles/engine/speculative.py)."""

    algorithm: Literal["STANDALONE", "EAGLE", "EAGLE3", "NEXTN"] = "STANDALONE"
    """STANDALONE: a separate draft model (`draft_model_path`); NEXTN: the model's own MTP layer
    (config num_nextn_predict_layers; model.tiny.mtp gives the tiny model one); EAGLE / EAGLE3: EAGLE
    heads (SGLang servers only)."""
    draft_model_path: str | None = None
    """HF directory of the draft model (STANDALONE: required; same tokenizer as the target)."""
    num_steps: int = Field(3, ge=1)
    """Draft tokens proposed per verify forward."""
    eagle_topk: int = Field(1, ge=1)
    """Draft branches per step (the embedded engine: 1, a chain)."""
    num_draft_tokens: int | None = Field(None, ge=2)
    """Tokens each verify forward checks (SGLang's flag; a chain: num_steps + 1, the default)."""
    max_batch: int | None = Field(32, ge=1)
    """The embedded engine speculates only in decode steps of at most this many requests (a large
    batch keeps the GPU busy already, where verifying k + 1 tokens a request costs more than the kept
    drafts save; the long tail of a step runs at small batch). None: every step. Its own flag
    (`--speculative-max-batch`), not given to SGLang servers."""
    adaptive: bool = True
    """The embedded engine measures, per batch size, speculative rounds against plain decode steps
    (seconds per generated token) and keeps the faster, probing the other every 256 steps
    (miles/engine/spec_gate.py); false: every step up to max_batch speculates. Its own flag
    (`--no-speculative-adaptive`), not given to SGLang servers."""


class EngineConfig(Section):
    """Rollout engine processes (the embedded engine or SGLang servers)."""

    kind: Literal["embedded", "sglang"] = "embedded"
    """`embedded` is Miles' own engine (CPU or GPU); `sglang` starts real SGLang servers (GPU clusters)."""
    urls: list[str] = []
    """`miles train`: URLs (http://host:port) of SGLang servers (or embedded engines) already running;
    none is started, supervised or stopped by Miles. Each must answer /model_info and /server_info
    and serve model.path's model; weights reach them by weights.transport (disk or distributed).
    engine.num_engines and the supervision keys do not apply to them."""
    num_engines: int = 1
    """Engine processes on one host (local runs); the sglang-router is put in front when more than one."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the embedded engine; `auto` picks cuda when available."""
    max_running_requests: int = 64
    """Requests decoded together in one engine (continuous batching width)."""
    max_total_tokens: int = 65536
    """KV-cache capacity of one engine in tokens."""
    release_memory_in_train: bool = True
    """Colocated + sync schedule: engines free their GPU memory (weights, KV cache, CUDA graphs) while
    the trainer trains and take it back after. Off keeps them resident, which saves the release, the
    resume and the graph captures when engine and trainer fit on the GPUs together."""
    mem_fraction_static: float = 0.5
    """SGLang: fraction of GPU memory for weights and KV cache."""
    tp_size: int = 1
    """SGLang: tensor-parallel size of one server."""
    dp_size: int = 1
    """SGLang: data-parallel replicas inside one server."""
    ep_size: int = 1
    """SGLang: expert-parallel size of one server."""
    router_policy: Literal["cache_aware", "round_robin", "power_of_two", "random", "manual"] = "cache_aware"
    """Policy of the sglang-router; `manual` keeps requests with one `X-SMG-Routing-Key` header on one worker."""
    startup_timeout_s: float = 300.0
    """How long to wait for every engine to report healthy."""
    max_restarts: int = 3
    """Local runs: how often a dead or unhealthy engine is replaced (the loop reloads the current
    weights into it and retries the samples in flight) before the run stops with an error."""
    health_check_interval_s: float = 5.0
    """Local runs: how often the launcher asks each engine's /health; 3 failures in a row and the
    engine is replaced like a dead one."""
    quantization: Literal["none", "fp8_block", "fp8_row", "int4", "mxfp8", "nvfp4"] = "none"
    """Low-precision weights of the rollout engines, each one contract with the trainer (the trainer
    ships its weights in this layout; train.quantization=fake_quant / int4_qat makes its forward see them).
    FP8 linear layers: the dense q/k/v/o and gate/up/down projections are stored in FP8 with 128x128
    block (`fp8_block`, SGLang's DeepSeek layout) or per-row (`fp8_row`) scales and quantised by the one
    contract of miles/quant/fp8.py; embeddings, lm_head, norms, routers and MoE experts stay in
    model.dtype (SGLang servers get `--quantization fp8`). `int4`: W4A16, compressed-tensors'
    pack-quantized groups (miles/quant/int4.py); `mxfp8` / `nvfp4`: the Blackwell block formats,
    emulated (dequantised) by the embedded engine on every other GPU and on the CPU (miles/quant/mx.py).
    These three cover the weights `quant_modules` names (miles/quant/formats.py)."""
    quant_modules: Literal["auto", "experts", "linear"] = "auto"
    """int4 / mxfp8 / nvfp4: the weights quantised: `experts` (MoE experts' projections, upstream's INT4
    QAT default), `linear` (those and every dense attention and MLP projection). `auto`: experts for
    int4 on a MoE model, linear otherwise."""
    int4_group_size: Literal[32, 128] = 128
    """int4: input columns sharing one scale (the model's hidden and intermediate sizes must be multiples)."""
    int4_max_rows: int = Field(4, ge=0)
    """int4, embedded engine on CUDA: GEMMs of at most this many rows (small-batch decode) run the int4
    kernel (tinygemm), larger ones a bf16 copy of the weights; 0: never the int4 kernel. The default is
    where the kernel still gained on one H200 (bench/RESULTS.md)."""
    fp8_min_tokens: int = Field(1024, ge=1)
    """Embedded engine: GEMMs with at least this many rows (prefill, large batches) run in FP8, smaller
    ones (decode) on CUDA multiply a model.dtype copy of the weight kept beside the FP8 one (2 bytes per
    covered parameter; 1 runs every GEMM in FP8 and keeps no copy). The default is the smallest GEMM size at
    which FP8 was measured to gain on one H200 (1.2-1.5x from 1k rows; 0.56-0.75x of bf16 at <= 256
    rows, activation quantisation included); the engine's --fp8-min-tokens has the same default."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (SpeculativeConfig); None: plain decoding."""
    fault_injection: bool = False
    """Testing only: engines serve POST /debug/inject_fault (miles.engine.server) to fake their faults."""

    @field_validator("urls")
    @classmethod
    def _urls_are_http(cls, urls: list[str]) -> list[str]:
        for url in urls:
            parts = urlparse(url)
            try:
                parts.port  # noqa: B018 (raises on a port that is not a number)
            except ValueError:
                parts = parts._replace(netloc="")
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
                raise ValueError(f"{url!r} is not a server URL; write http://HOST:PORT")
        if len(set(urls)) != len(urls):
            raise ValueError("a URL is listed twice")
        return urls


def check_speculative(plan: Plan) -> None:
    """Refuse speculative settings the engines cannot run, naming the key to change."""
    spec = plan.engine.speculative
    if spec is None:
        return
    if spec.algorithm == "STANDALONE" and not spec.draft_model_path:
        raise ConfigError("engine.speculative.algorithm=STANDALONE needs engine.speculative.draft_model_path")
    if plan.engine.kind == "embedded" and not plan.engine.urls:
        if spec.algorithm not in ("STANDALONE", "NEXTN"):
            raise ConfigError(
                f"engine.speculative.algorithm={spec.algorithm} drafts with EAGLE heads, which the embedded "
                "engine does not load: set it to NEXTN (the model's MTP layer), STANDALONE with a "
                "draft_model_path, or engine.kind=sglang"
            )
        if spec.algorithm == "NEXTN":
            _check_mtp_layer(plan)
        if spec.eagle_topk != 1 or spec.num_draft_tokens not in (None, spec.num_steps + 1):
            raise ConfigError(
                "the embedded engine drafts a chain: set engine.speculative.eagle_topk=1 and leave "
                "engine.speculative.num_draft_tokens unset (num_steps + 1)"
            )


def _check_mtp_layer(plan: Plan) -> None:
    """NEXTN on the embedded engine: the model (or the tiny one it will be made as) has an MTP layer."""
    import json
    from pathlib import Path

    config = Path(plan.model.path) / "config.json"
    if config.is_file():
        has = bool(json.loads(config.read_text()).get("num_nextn_predict_layers"))
    else:
        has = not plan.model.init_tiny_if_missing or plan.model.tiny.mtp
    if not has:
        raise ConfigError(
            "engine.speculative.algorithm=NEXTN drafts with the model's MTP layer, and model.path has none "
            "(config num_nextn_predict_layers): set model.tiny.mtp=true for a tiny model, use a checkpoint "
            "with one, or STANDALONE with engine.speculative.draft_model_path"
        )


def check_external_engines(plan: Plan) -> None:
    """With `engine.urls`, refuse what servers that Miles did not place cannot do (ConfigError naming
    the key): they run wherever they were started, so neither a colocated layout nor the tensor
    transport (CUDA IPC handles to engines on the trainer's own GPUs) can reach them."""
    if not plan.engine.urls:
        return
    if plan.launch.layout == "colocated":
        raise ConfigError(
            "launch.layout=colocated puts the engines Miles starts on the trainer's GPUs; the servers of "
            "engine.urls run where they were started: set launch.layout=disaggregated"
        )
    if plan.weights.transport == "tensor":
        raise ConfigError(
            "weights.transport=tensor hands CUDA IPC handles to engines Miles colocates with the trainer; "
            "it cannot reach the servers of engine.urls: set weights.transport=distributed (or disk, when "
            "the servers can read the run directory)"
        )
