"""Qwen3-MoE in the Megatron backend on CUDA: weights export, logits vs transformers, routing replay
through megatron-core's RouterReplay (the experts used are the given ones, the router still learns),
the training step vs the FSDP backend's, and expert / uneven pipeline parallelism on two GPUs.

The model: a tiny random Qwen3-MoE (hidden 256, 4 layers, the first dense, 8 experts, top-2). Given
routing is random (k distinct experts per token and sparse layer), so it differs from the router's own
choice and a replay that does not happen shows. With the same given routing FSDP (transformers' model
with miles/train/routing_replay.py) and Megatron compute the same function, so in fp32 with TF32 off
they differ by summation order only (tolerances as tests/gpu/test_backends_agree.py).

    torchrun --standalone --nproc-per-node 2 tests/gpu/test_megatron_moe_gpu.py MODEL RUNS EP PP FIRST

runs one layout of the two-GPU test (FIRST: layers of the first pipeline stage, 0 for the even split).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_backends_agree import TOL, fsdp_grads, megatron_backend, megatron_grads  # noqa: E402
from test_fsdp_gpu import fsdp_backend, make_samples  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core is CUDA-only)"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

SIZES = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_experts=8,
    num_experts_per_tok=2,
)  # layer 0 dense (miles.models.tiny's mlp_only_layers=[0])
TRAIN = dict(grad_clip=1e6, lr=1e-4, max_tokens_per_microbatch=64)


def with_routing(samples: list, seed: int) -> list:
    """`samples` with random rollout routing: k distinct experts per token (but the last) and sparse
    layer, SGLang's layout [tokens - 1, layers * k] (dense layer 0 all zeros)."""
    rng = np.random.default_rng(seed)
    E, k, L = SIZES["num_experts"], SIZES["num_experts_per_tok"], SIZES["num_hidden_layers"]
    for s in samples:
        rows = np.zeros((len(s.tokens) - 1, L, k), dtype=np.uint8)
        for t in range(rows.shape[0]):
            for layer in range(1, L):
                rows[t, layer] = rng.permutation(E)[:k]
        s.routed_experts = rows.reshape(len(s.tokens) - 1, L * k)
    return samples


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from miles.models.tiny import init_tiny

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    root = tmp_path_factory.mktemp("meg_moe")
    path = str(init_tiny(root / "tiny-moe", arch="qwen3_moe", seed=5, **SIZES))
    return path, str(root / "runs"), with_routing(make_samples(path, n=8, seed=6), seed=7)


def _export(b) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for bk in b.export_weights(1 << 20) for k, v in bk}


def _hf(path: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


def test_export_reproduces_the_checkpoint(env):
    from miles.train.megatron.model import read_hf_state

    b = megatron_backend(env[0], env[1], "export", "float32")
    want = read_hf_state(env[0])
    got = _export(b)
    assert got.keys() == want.keys(), f"names differ: {sorted(set(got) ^ set(want))[:8]}"
    bad = [k for k in want if not torch.equal(got[k], want[k].float())]
    assert not bad, f"exported tensors differ from the checkpoint: {bad[:8]}"


def _hf_routing(hf, ids: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """transformers' logits of ids [B, S] and its routing as SGLang rows per sequence [B, S - 1, L * k]."""
    from miles.train.routing_replay import find_routers

    seen: dict[int, torch.Tensor] = {}
    hooks = [
        r.register_forward_hook(lambda m, i, out, layer=layer: seen.__setitem__(layer, out[2]))
        for layer, r in find_routers(hf)
    ]
    try:
        with torch.no_grad():
            logits = hf(ids).logits.float()
    finally:
        for h in hooks:
            h.remove()
    B, S = ids.shape
    L, k = SIZES["num_hidden_layers"], SIZES["num_experts_per_tok"]
    rows = np.zeros((B, S, L, k), dtype=np.uint8)
    for layer, idx in seen.items():
        rows[:, :, layer] = idx.reshape(B, S, k).cpu().numpy()  # token t of sequence b is row b * S + t
    return logits, rows[:, :-1].reshape(B, S - 1, L * k)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_logits_match_transformers(env, dtype, tol):
    """fp32: the router's own choice and the logits equal transformers'. bf16: rounding can flip a
    near tie, so the fp32 model's routing is replayed and only rounding is left."""
    from miles.sample import Sample

    b = megatron_backend(env[0], env[1], f"logits_{dtype}", dtype)
    torch.manual_seed(0)
    ids = torch.randint(4, 380, (2, 33), device="cuda")
    pos = torch.arange(33, device="cuda").expand(2, 33)
    ref, rows = _hf_routing(_hf(env[0]), ids)
    ctx = contextlib.nullcontext()
    if dtype == "bfloat16":  # the last position has no row (as in a rollout): it is left out below
        seqs = [
            Sample(0, i, ids[i, :2].tolist(), ids[i, 2:].tolist(), [1] * 31, [0.0] * 31) for i in range(2)
        ]
        for s, r in zip(seqs, rows, strict=True):
            s.routed_experts = r
        b.moe.replay = True
        ctx = b.moe.micro_batch(seqs, types.SimpleNamespace(tokens=ids, sample_ids=[0, 1]))
    with torch.no_grad(), ctx:
        ours = b.model.module(ids, pos, None).float()
    keep = slice(None) if dtype == "float32" else slice(0, -1)
    err = ((ours[:, keep] - ref[:, keep]).norm() / ref[:, keep].norm()).item()
    print(f"logits rel err {dtype}: {err:.2e}")
    assert err < tol, f"Megatron MoE logits differ from transformers' ({dtype}): rel err {err:.2e}"


def _router_taps(b) -> tuple[list, list]:
    """Forward hooks on every TopKRouter: (experts given by RouterReplay [T, k], routing map [T, E])."""
    from megatron.core.transformer.moe.router import TopKRouter

    seen: list = []

    def tap(module, inputs, out):
        given = module.router_replay.target_topk_idx
        seen.append((None if given is None else given.clone(), out[1].detach().clone()))

    hooks = [m.register_forward_hook(tap) for m in b.gpt.modules() if isinstance(m, TopKRouter)]
    return seen, hooks


def test_replay_routes_to_the_given_experts_and_the_router_learns(env):
    samples = env[2]
    b = megatron_backend(env[0], env[1], "replay", "float32", routing_replay="rollout", **TRAIN)
    seen, hooks = _router_taps(b)
    before = _export(b)
    m = b.train(samples)
    for h in hooks:
        h.remove()
    n_moe = SIZES["num_hidden_layers"] - 1
    rows = sum(len(s.tokens) - 1 for s in samples)
    replayed = 0
    for given, used in seen:
        assert given is not None, "a router ran without the rollout's experts"
        valid = (given >= 0).all(-1)
        idx = given[valid].long()
        want = torch.zeros_like(used[valid]).scatter(1, idx, torch.ones_like(idx, dtype=torch.bool))
        assert torch.equal(used[valid], want), "Megatron routed tokens to experts other than the given ones"
        replayed += int(valid.sum())
    assert replayed == rows * n_moe, f"{replayed} replayed (token, layer) pairs, expected {rows * n_moe}"
    print({k: v for k, v in m.items() if not k.startswith("moe_expert_load")})
    assert m["router_agreement"] == 1.0
    assert m["router_natural_agreement"] < 0.9, "random routing should rarely be the router's own"
    loads = [m[f"moe_expert_load/{e}"] for e in range(SIZES["num_experts"])]
    assert abs(sum(loads) - 1.0) < 1e-6 and m["moe_load_imbalance"] >= 1.0 and m["moe_aux_loss"] > 0
    grads = {n: p.main_grad.norm().item() for n, p in b.gpt.named_parameters() if n.endswith("router.weight")}
    assert len(grads) == n_moe and all(g > 0 for g in grads.values()), f"router gradients: {grads}"
    after = _export(b)
    gates = [k for k in before if k.endswith("mlp.gate.weight")]
    assert gates and all(not torch.equal(before[k], after[k]) for k in gates), "router weights did not move"


def test_without_replay_the_router_chooses(env):
    b = megatron_backend(env[0], env[1], "noreplay", "float32", **TRAIN)
    m = b.train(env[2])
    assert m["router_agreement"] == m["router_natural_agreement"] < 0.9
    assert math.isfinite(m["loss"]), m


def _stacked_to_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from miles.train.fsdp.weights import checkpoint_names

    return {n: t for name, g in grads.items() for n, t in checkpoint_names(name, g)}


def test_fsdp_and_megatron_agree_under_replay(env):
    """fp32, same given routing: loss, grad norm, every parameter's gradient, router metrics."""
    tol = TOL["float32"]
    fs = fsdp_backend(env[0], env[1], "moe_fsdp", "float32", routing_replay="rollout", **TRAIN)
    m_f = fs.train(env[2])
    g_f = _stacked_to_names(fsdp_grads(fs))
    mg = megatron_backend(env[0], env[1], "moe_meg", "float32", routing_replay="rollout", **TRAIN)
    m_m = mg.train(env[2])
    g_m = megatron_grads(mg)
    assert g_f.keys() == g_m.keys(), f"names differ: {sorted(set(g_f) ^ set(g_m))[:8]}"
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in g_m.values()))
    errs = {k: float((g_f[k] - g_m[k]).norm() / (g_m[k].norm() + 1e-3 * total)) for k in g_m}
    worst = max(errs, key=errs.get)
    print(
        f"loss fsdp {m_f['loss']:.6f} megatron {m_m['loss']:.6f}; grad_norm fsdp {m_f['grad_norm']:.6f} "
        f"megatron {m_m['grad_norm']:.6f}; worst tensor {worst} {errs[worst]:.2e}"
    )
    assert total > 0 and m_f["tokens"] == m_m["tokens"]
    assert abs(m_f["loss"] - m_m["loss"]) <= tol["loss"] * max(1.0, abs(m_m["loss"]))
    assert abs(m_f["grad_norm"] - m_m["grad_norm"]) <= tol["grad_norm"] * m_m["grad_norm"]
    assert errs[worst] <= tol["tensor"], sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    assert m_f["router_agreement"] == m_m["router_agreement"] == 1.0
    for key in [k for k in m_f if k.startswith("moe_") and k != "moe_aux_loss"]:  # counts: batching-free
        assert abs(m_f[key] - m_m[key]) < 5e-3, f"{key}: fsdp {m_f[key]} megatron {m_m[key]}"
    # the aux loss is a per-micro-batch product of means: the backends cut micro-batches differently
    assert abs(m_f["moe_aux_loss"] - m_m["moe_aux_loss"]) < 0.25 * m_f["moe_aux_loss"]


def _replayed_logprobs(hf, samples):
    """transformers' response log-probs with each sample's rollout routing replayed."""
    from miles.train.routing_replay import RoutingReplay, packed_routing

    rr = RoutingReplay.install(hf, replay=True)
    out = []
    for s in samples:
        ids = torch.tensor([s.tokens], device="cuda")
        with rr.batch(packed_routing([s], [0], rr.shape, required=True), measure=False):
            logits = hf(ids).logits[0].float()
        p = len(s.prompt_ids)
        out.append(torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, ids[0, p:, None]).squeeze(-1))
    return out


def replayed_reference_step(path: str, samples: list, lr: float):
    """tests/gpu/test_megatron_gpu.py's HF reference step (AdamW, clip 1.0, fp32) with the routing
    replayed; the updated weights under checkpoint names."""
    import test_megatron_gpu as T

    plain, T._hf_logprobs = T._hf_logprobs, _replayed_logprobs
    try:
        loss, gn, state = T._reference_step((path, None, None), samples, lr)
    finally:
        T._hf_logprobs = plain
    return loss, gn, _stacked_to_names(state)


@pytest.mark.gpu2
@pytest.mark.parametrize("ep,pp,first", [(2, 1, 0), (1, 2, 1)])
def test_expert_and_uneven_pipeline_parallel_match_reference(env, ep, pp, first):
    """EP=2 (experts 0-3 / 4-7, DP=2) and PP=2 with the dense layer alone on the first stage: weights
    export and one replayed training step equal the single-model reference."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
    args = [env[0], env[1] + f"/ep{ep}pp{pp}", str(ep), str(pp), str(first)]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300)
    print(proc.stdout[-2000:], proc.stderr[-6000:] if proc.returncode else "")
    assert proc.returncode == 0, f"ranks failed (ep={ep}, pp={pp}, first={first}); stderr above"
    assert "RESULT" in proc.stdout


def _rank_main() -> None:
    import torch.distributed as dist

    model, runs, ep, pp, first = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    torch.backends.cuda.matmul.allow_tf32 = False
    world = int(os.environ["WORLD_SIZE"])
    layout = dict(expert_parallel=ep, pipeline_parallel=pp, num_ranks=world, routing_replay="rollout")
    if first:
        layout["pipeline_first_stage_layers"] = first
    train = dict(TRAIN, grad_clip=1.0, lr=1e-3)
    b = megatron_backend(model, runs, "layout", "float32", **train, **layout)
    rank = dist.get_rank()
    box = [with_routing(make_samples(model, n=8, seed=6), seed=7) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    before = _export(b)
    m = b.train(box[0])
    after = _export(b)
    if rank != 0:
        return
    from miles.train.megatron.model import read_hf_state

    want = read_hf_state(model)
    assert before.keys() == want.keys(), f"names differ: {sorted(set(before) ^ set(want))[:8]}"
    assert all(torch.equal(before[k], want[k].float()) for k in want), "export differs from the checkpoint"
    loss, gn, ref_after = replayed_reference_step(model, box[0], 1e-3)
    d_ours = torch.cat([(after[k] - before[k]).flatten() for k in before])
    d_ref = torch.cat([(ref_after[k] - before[k]).flatten() for k in before])
    res = dict(
        ep=ep,
        pp=pp,
        first=first,
        loss=m["loss"],
        ref_loss=loss,
        grad_norm=m["grad_norm"],
        ref_grad_norm=gn,
        router_agreement=m["router_agreement"],
        update_rel_diff=((d_ours - d_ref).norm() / d_ref.norm()).item(),
    )
    print("RESULT", json.dumps(res))
    assert abs(res["loss"] - loss) < 1e-4, res
    assert abs(gn - res["grad_norm"]) < 1e-3 * gn, res
    assert res["update_rel_diff"] < 1e-2 and res["router_agreement"] == 1.0, res


if __name__ == "__main__":
    _rank_main()
