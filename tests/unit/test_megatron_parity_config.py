"""CPU checks of the Megatron parity settings: context parallelism, activation recompute and optimizer
offload in the layout rules (miles/config/layout.py), their megatron-core fields, the strict-load
message of the Megatron checkpoint, and the packed micro-batch layout (no GPU, no megatron-core)."""

from __future__ import annotations

import pytest
import torch

from miles.config import ConfigError, Plan
from miles.config.layout import check_layout


def _plan(model: dict | None = None, **train) -> Plan:
    return Plan.model_validate({"train": train, **({"model": model} if model else {})})


def _error(plan: Plan, ranks: int | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        check_layout(plan, ranks)
    return str(e.value)


# ------------------------------------------------------------------------ context parallelism


@pytest.mark.parametrize(("backend", "tp", "ranks"), [("megatron", 2, 6), ("fsdp", 1, 3)])
def test_context_parallel_ranks_must_divide_with_tp_and_pp(backend: str, tp: int, ranks: int) -> None:
    msg = _error(_plan(backend=backend, context_parallel=2, tensor_parallel=tp), ranks=ranks)
    assert "train.tensor_parallel x train.pipeline_parallel x train.context_parallel" in msg
    assert "change train.num_ranks" in msg


def test_context_parallel_token_budget_splits_into_two_chunks_per_rank() -> None:
    msg = _error(_plan(backend="megatron", context_parallel=4, max_tokens_per_microbatch=100), ranks=4)
    assert "train.max_tokens_per_microbatch=100 must be a multiple of 8" in msg


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_context_parallel_is_refused_by_both_backends(backend: str) -> None:
    msg = _error(_plan(backend=backend, context_parallel=2), ranks=4)
    assert f"train.context_parallel=2 is not supported yet by train.backend={backend}" in msg
    assert "set train.context_parallel=1" in msg


def test_context_parallel_below_one_is_refused() -> None:
    assert "train.context_parallel must be >= 1" in _error(_plan(backend="megatron", context_parallel=0))


# --------------------------------------------------------------------------------- recompute


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_is_megatron_only(mode: str) -> None:
    check_layout(_plan(backend="megatron", recompute=mode), 1)
    msg = _error(_plan(backend="fsdp", recompute=mode), 1)
    assert f"train.recompute={mode} is built for train.backend=megatron only" in msg


def test_unknown_recompute_mode_is_a_config_error() -> None:
    with pytest.raises((ConfigError, ValueError), match="recompute"):
        _plan(backend="megatron", recompute="everything")


def test_recompute_maps_to_megatron_core_fields() -> None:
    from miles.train.megatron.backend import recompute_config

    assert recompute_config("none") == {}
    assert recompute_config("selective") == {
        "recompute_granularity": "selective",
        "recompute_modules": ["core_attn"],
    }
    full = recompute_config("full")
    assert full["recompute_granularity"] == "full" and full["recompute_method"] == "uniform"
    assert full["recompute_num_layers"] == 1


# ------------------------------------------------------------------------- optimizer offload


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_megatron_offload_needs_bf16_and_fp32_moments(mode: str) -> None:
    check_layout(_plan({"dtype": "bfloat16"}, backend="megatron", optimizer_offload=mode), 1)
    msg = _error(_plan({"dtype": "float32"}, backend="megatron", optimizer_offload=mode))
    assert f"train.optimizer_offload={mode} with train.backend=megatron needs model.dtype=bfloat16" in msg
    plan = _plan(
        {"dtype": "bfloat16"}, backend="megatron", optimizer_offload=mode, offload_moment_dtype="bf16"
    )
    assert "set train.offload_moment_dtype=fp32" in _error(plan)


@pytest.mark.parametrize("mode", ["cpu", "nvme"])
def test_offload_maps_to_megatron_core_hybrid_optimizer_fields(mode: str) -> None:
    from miles.train.megatron.backend import offload_config

    assert offload_config("none") == {}
    fields = offload_config(mode)
    assert fields["optimizer_cpu_offload"] is True and fields["optimizer_offload_fraction"] == 1.0
    assert fields["use_precision_aware_optimizer"] is True
    # nvme streams one CPU AdamW (one shard) at a time: megatron-core builds one per shard with this flag
    assert fields.get("overlap_cpu_optimizer_d2h_h2d", False) is (mode == "nvme")


def test_kl_is_no_longer_refused_by_the_megatron_layout() -> None:
    check_layout(_plan(backend="megatron", loss={"kl_coef": 0.1}), 1)


# ------------------------------------------------------------------------------ strict load


def test_key_mismatch_lists_a_few_keys_then_counts() -> None:
    from miles.train.megatron.checkpoint import key_mismatch

    model = {f"decoder.layers.q_layernorm.w{i}" for i in range(8)} | {"embedding.word_embeddings.weight"}
    ckpt = {"embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.bias"}
    msg = key_mismatch(model, ckpt, "/runs/x/checkpoints/step_3/megatron/dist")
    assert msg is not None
    assert "8 missing (the model has them, the checkpoint does not)" in msg
    assert "decoder.layers.q_layernorm.w0" in msg and "and 3 more" in msg
    assert (
        "1 unexpected (in the checkpoint, not in the model): decoder.layers.self_attention.linear_qkv.bias"
        in msg
    )
    assert "step_3" in msg and "model.path" in msg
    assert key_mismatch(ckpt, ckpt, "x") is None


def _adam(params: list[torch.nn.Parameter], **kw) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        [{"params": params[:3]}, {"params": params[3:]}], lr=1e-3, weight_decay=0.0, **kw
    )


def _grads(params: list[torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("kw", [{"foreach": True}, {"foreach": False}, {"fused": True}])
def test_resumed_adam_steps_like_the_uninterrupted_one(kw: dict) -> None:
    """The load path of miles/train/megatron/checkpoint.py on a plain torch AdamW: megatron-core's
    load_state_dict (no Transformer Engine / apex) gives every parameter's state one shared `step`
    tensor, then its fully_reshardable loader copies moments in with the steps set aside. The next
    update must equal the uninterrupted optimizer's (a shared step would advance once per parameter)."""
    from types import SimpleNamespace

    from miles.train.megatron.checkpoint import _ensure_optimizer_state, _steps_aside

    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (4,), (4, 4), (16, 4), (4,)]
    a = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt_a = _adam(a, **kw)
    _grads(a, 1)
    opt_a.step()
    saved = [p.detach().clone() for p in a]
    moments = [{k: v.clone() for k, v in opt_a.state[p].items() if k != "step"} for p in a]
    _grads(a, 2)
    opt_a.step()

    b = [torch.nn.Parameter(w.clone()) for w in saved]
    opt_b = _adam(b, **kw)
    config = SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    _ensure_optimizer_state(SimpleNamespace(optimizer=opt_b, config=config))
    assert all(torch.equal(pb, w) for pb, w in zip(b, saved, strict=True)), "the state-creating step moved"
    packed = opt_b.state_dict()
    shared = torch.tensor(1.0)
    for st in packed["state"].values():
        st["step"] = shared
    opt_b.load_state_dict(packed)
    with _steps_aside(opt_b):
        for p, m in zip(b, moments, strict=True):
            for k, v in m.items():
                opt_b.state[p][k].copy_(v)
    steps = [opt_b.state[p]["step"] for p in b]
    assert len({id(t) for t in steps}) == len(b), "parameters share one step tensor after loading"
    assert all(float(t) == 1.0 for t in steps), [float(t) for t in steps]
    _grads(b, 2)
    opt_b.step()
    assert all(float(opt_b.state[p]["step"]) == 2.0 for p in b), [float(opt_b.state[p]["step"]) for p in b]
    for i, (pa, pb) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(pa, pb), f"parameter {i} differs after the resumed step"


# ---------------------------------------------------------------------- packed micro-batches


def _samples():
    from miles.sample import Sample

    return [
        Sample(0, 0, [5, 6], [7, 8, 9], [1, 0, 1], [-1.0, -2.0, -3.0], reward=1.0),
        Sample(0, 1, [10], [11, 12], [1, 1], [-4.0, -5.0], reward=0.0),
        Sample(1, 0, [13, 14, 15], [16], [1], [-6.0], reward=0.5),
    ]


def test_packed_micro_batch_is_one_row_with_restarting_positions() -> None:
    from miles.train.megatron import batch as B

    (mb,) = B.pack(_samples(), [1.0, 2.0, 3.0], 64, torch.device("cpu"), packed=True)
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    # logit at p predicts token p + 1: responses start at 2, 6 and 11
    assert mb.cols.tolist() == [1, 2, 3, 5, 6, 10] and mb.rows.tolist() == [0] * 6
    assert mb.targets.tolist() == [7, 8, 9, 11, 12, 16]
    assert mb.seq_index.tolist() == [0, 0, 0, 1, 1, 2]
    assert mb.advantages.tolist() == [1.0, 1.0, 1.0, 2.0, 2.0, 3.0]
    assert mb.cu_seqlens.tolist() == [0, 5, 8, 12] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 5


def test_padded_micro_batches_keep_the_same_per_token_order() -> None:
    from miles.train.megatron import batch as B

    (packed,) = B.pack(_samples(), [1.0, 2.0, 3.0], 64, torch.device("cpu"), packed=True)
    (padded,) = B.pack(_samples(), [1.0, 2.0, 3.0], 64, torch.device("cpu"), packed=False)
    assert padded.tokens.shape == (3, 5) and padded.cu_seqlens is None
    for name in ("targets", "mask", "rollout_logp", "advantages", "seq_index"):
        assert torch.equal(getattr(packed, name), getattr(padded, name)), name


def test_packing_budget_counts_tokens_without_padding() -> None:
    from miles.train.megatron.batch import plan_micro_batches

    assert plan_micro_batches([3, 4, 5, 2], 7, packed=True) == [[0, 1], [2, 3]]
    assert plan_micro_batches([3, 4, 5, 2], 8, packed=False) == [[0, 1], [2], [3]]
    assert plan_micro_batches([9, 2], 4, packed=True) == [[0], [1]], "a long sequence goes alone"


def test_a_single_sequence_needs_no_mask() -> None:
    from miles.train.megatron import batch as B

    mbs = B.pack(_samples(), [0.0] * 3, 5, torch.device("cpu"), packed=True)
    assert [mb.sample_ids for mb in mbs] == [[0], [1], [2]]
    assert all(mb.cu_seqlens is None for mb in mbs)
