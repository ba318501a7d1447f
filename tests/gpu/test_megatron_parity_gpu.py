"""The Megatron backend's parity with FSDP on a CUDA GPU: KL to a frozen reference, optimizer state
offloaded to the CPU (megatron-core's hybrid optimizer) or streamed through NVMe, strict and
layout-independent distributed checkpoints, activation recompute, and packed micro-batches. Skipped
without CUDA or megatron-core.

The tiny model, plans and samples are those of test_megatron_gpu.py. The changed-layout resume runs
this file under torchrun on two GPUs (skipped with fewer):

    torchrun --standalone --nproc-per-node 2 tests/gpu/test_megatron_parity_gpu.py PHASE MODEL RUNS TP PP
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from test_megatron_gpu import _export, _hf_logprobs, _plan, _samples
from test_megatron_gpu import env as _tiny_model_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core forward is CUDA-only)"
    ),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

env = _tiny_model_env
"""test_megatron_gpu.py's module fixture: (tiny qwen2 model path, runs root, its HF model on the GPU)."""


def _make(model: str, runs: str, dtype: str = "float32", **train):
    """A set-up MegatronBackend whose run directory is runs/<dtype> (a test's own `runs`)."""
    from miles.train.megatron.backend import MegatronBackend

    b = MegatronBackend()
    b.setup(_plan(model, runs, dtype, **train))
    return b


def _update_rel_diff(before: dict, after: dict, ref_after: dict) -> float:
    """|(after - before) - (ref_after - before)| / |ref_after - before| over all weights."""
    ours = torch.cat([(after[k] - before[k]).flatten() for k in before])
    ref = torch.cat([(ref_after[k] - before[k]).flatten() for k in before])
    assert ref.norm() > 0, "the reference update is zero"
    return ((ours - ref).norm() / ref.norm()).item()


def _logits(b, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1], device="cuda").expand_as(ids)
    with torch.no_grad():
        return b.model.module(ids, pos, None).float()


# ------------------------------------------------------------------------------------------ KL


def test_kl_is_zero_against_the_reference_then_grows(env, tmp_path):
    samples = _samples(env[2], seed=7)
    b = _make(env[0], str(tmp_path), lr=1e-2, loss={"kl_coef": 0.5})
    assert b.ref_model is not None, "kl_coef > 0 must build a reference model"
    ref_before = [p.detach().clone() for p in b.ref_model.parameters()]
    first = b.train(samples)
    second = b.train(samples)
    print("step 1", first, "\nstep 2", second)
    assert math.isfinite(first["loss"]) and math.isfinite(second["loss"])
    assert abs(first["kl"]) < 1e-6, f"policy == reference before any update, yet kl={first['kl']}"
    assert second["kl"] > 1e-6, f"kl after one update should be > 0, got {second['kl']}"
    assert second["kl_loss"] > 0, f"kl_loss should be > 0 with kl_coef=0.5, got {second['kl_loss']}"
    assert all(torch.equal(p, q) for p, q in zip(b.ref_model.parameters(), ref_before, strict=True)), (
        "the reference model changed during training"
    )


def test_kl_off_keeps_no_reference(env, tmp_path):
    b = _make(env[0], str(tmp_path))
    assert b.ref_model is None
    m = b.train(_samples(env[2], seed=8))
    assert m["kl"] == 0.0 and m["kl_loss"] == 0.0


# -------------------------------------------------------------------------------- CPU offload


def test_cpu_optimizer_offload_matches_the_gpu_optimizer(env, tmp_path):
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    samples = _samples(env[2], seed=11)
    plain = _make(env[0], str(tmp_path / "plain"), "bfloat16")
    off = _make(env[0], str(tmp_path / "off"), "bfloat16", optimizer_offload="cpu")
    inners = [o.optimizer for o in getattr(off.optimizer, "chained_optimizers", [off.optimizer])]
    assert all(isinstance(i, HybridDeviceOptimizer) for i in inners), [type(i) for i in inners]
    before = _export(plain)
    a = [plain.train(samples) for _ in range(2)]
    b = [off.train(samples) for _ in range(2)]
    print("gpu optimizer", a, "\ncpu optimizer", b)
    assert abs(a[0]["loss"] - b[0]["loss"]) < 1e-5, "same weights, same first loss"
    assert abs(a[0]["grad_norm"] - b[0]["grad_norm"]) < 1e-3 * a[0]["grad_norm"]
    assert abs(a[1]["loss"] - b[1]["loss"]) < 1e-2 * max(1.0, abs(a[1]["loss"]))
    rel = _update_rel_diff(before, _export(off), _export(plain))
    print(f"offloaded update rel diff {rel:.2e}")
    assert rel < 5e-2, f"CPU-offloaded updates differ from the GPU optimizer's by {rel:.2e}"
    tensors = [v for i in inners for st in i.state.values() for v in st.values() if torch.is_tensor(v)]
    assert tensors and all(v.device.type == "cpu" for v in tensors), (
        f"optimizer state on {sorted({str(v.device) for v in tensors})}, expected cpu only"
    )


def test_cpu_offload_checkpoint_round_trip(env, tmp_path):
    samples = _samples(env[2], seed=12)
    a = _make(env[0], str(tmp_path), "bfloat16", optimizer_offload="cpu")
    a.train(samples)
    a.save(1)
    saved = _export(a)
    next_a = a.train(samples)
    b = _make(env[0], str(tmp_path), "bfloat16", optimizer_offload="cpu")
    b.load(None)
    assert all(torch.equal(v, saved[k]) for k, v in _export(b).items()), "weights differ after load"
    next_b = b.train(samples)
    assert abs(next_a["loss"] - next_b["loss"]) < 1e-5
    rel = _update_rel_diff(saved, _export(b), _export(a))
    assert rel < 5e-2, f"the resumed CPU optimizer's update differs by {rel:.2e} (moments not restored?)"


# ------------------------------------------------------------------------------- NVMe offload


def _nvme(model: str, runs: str, offload_dir: Path):
    """A bf16 backend whose optimizer state streams through offload_dir (which may be any local disk
    here, hence offload_require_local=false)."""
    offload_dir.mkdir(parents=True, exist_ok=True)
    return _make(
        model,
        runs,
        "bfloat16",
        optimizer_offload="nvme",
        offload_dir=str(offload_dir),
        offload_require_local=False,
    )


def _assert_spilled(b) -> None:
    """Between steps every master copy and moment of the streamed optimizer is in its files, not in memory."""
    from miles.train.megatron.nvme import StreamedHybridOptimizer

    inners = [o.optimizer for o in getattr(b.optimizer, "chained_optimizers", [b.optimizer])]
    assert all(isinstance(i, StreamedHybridOptimizer) for i in inners), [type(i) for i in inners]
    for inner in inners:
        manifest = json.loads((inner.store.root / "manifest.json").read_text())
        sizes = [(inner.store.root / f).stat().st_size for f in manifest["files"]]
        assert sizes == [bk.nbytes for bk in inner.buckets], f"shard files {manifest['files']} sizes {sizes}"
        for opt in inner.cpu_optimizers:
            for p in (p for g in opt.param_groups for p in g["params"]):
                kept = [k for k, v in opt.state.get(p, {}).items() if torch.is_tensor(v) and v.numel() > 1]
                assert p.numel() == 0 and not kept, (
                    f"a shard stays in host memory: {p.numel()} elements, {kept}"
                )


def test_nvme_optimizer_offload_matches_cpu_offload(env, tmp_path):
    samples = _samples(env[2], seed=13)
    cpu = _make(env[0], str(tmp_path / "cpu"), "bfloat16", optimizer_offload="cpu")
    nvme = _nvme(env[0], str(tmp_path / "nvme"), tmp_path / "offload")
    _assert_spilled(nvme)
    for step in range(2):
        a, b = cpu.train(samples), nvme.train(samples)
        print(f"step {step + 1}: cpu offload {a}\nnvme offload {b}")
        assert abs(a["loss"] - b["loss"]) < 1e-6, f"step {step + 1}: losses {a['loss']} vs {b['loss']}"
        _assert_spilled(nvme)
    ours, ref = _export(nvme), _export(cpu)
    diff = torch.cat([(ours[k].float() - ref[k].float()).flatten() for k in ref]).norm()
    rel = (diff / torch.cat([v.float().flatten() for v in ref.values()]).norm()).item()
    print(f"nvme vs cpu offload weights rel diff {rel:.2e}")
    assert rel < 1e-6, f"NVMe-streamed updates differ from the CPU-offloaded ones by {rel:.2e}"


def test_nvme_offload_checkpoint_round_trip(env, tmp_path):
    samples = _samples(env[2], seed=12)
    a = _nvme(env[0], str(tmp_path), tmp_path / "offload_a")
    a.train(samples)
    a.save(1)
    _assert_spilled(a)
    saved = _export(a)
    next_a = a.train(samples)
    b = _nvme(env[0], str(tmp_path), tmp_path / "offload_b")
    b.load(None)
    _assert_spilled(b)
    assert all(torch.equal(v, saved[k]) for k, v in _export(b).items()), "weights differ after load"
    next_b = b.train(samples)
    assert abs(next_a["loss"] - next_b["loss"]) < 1e-5
    rel = _update_rel_diff(saved, _export(b), _export(a))
    assert rel < 1e-6, f"the resumed NVMe-streamed update differs by {rel:.2e} (state not restored?)"


# ------------------------------------------------------------------------------- checkpoints


def test_dist_checkpoint_resumes_in_a_fresh_backend(env, tmp_path):
    from miles.train.checkpoint import read_marker, step_dir

    samples = _samples(env[2], seed=9)
    a = _make(env[0], str(tmp_path))
    a.train(samples)
    path = a.save(1, {"data_pos": 3})
    marker = read_marker(step_dir(a.plan.run_dir, 1))
    assert marker and any(n.startswith("megatron/dist/") for n in marker["files"]), (
        f"the .complete marker does not record the distributed checkpoint: {marker}"
    )
    saved = _export(a)
    next_a = a.train(samples)
    after_a = _export(a)
    b = _make(env[0], str(tmp_path))
    assert b.load(None) == {"data_pos": 3} and path.endswith("step_1")
    assert b.step_count == 1
    assert all(torch.equal(v, saved[k]) for k, v in _export(b).items()), "weights differ after load"
    ids = torch.randint(4, 380, (2, 17), device="cuda")
    a.load(1)
    assert torch.equal(_logits(a, ids), _logits(b, ids)), "logits differ between saver and loader"
    next_b = b.train(samples)
    assert abs(next_a["loss"] - next_b["loss"]) < 1e-6
    rel = _update_rel_diff(saved, _export(b), after_a)
    print(f"resumed update rel diff {rel:.2e}")
    assert rel < 1e-3, f"the resumed optimizer's update differs by {rel:.2e} (master weights/moments?)"


def test_strict_load_names_the_missing_keys(env, tmp_path):
    from miles.models.tiny import init_tiny
    from miles.train.checkpoint import CheckpointError

    a = _make(env[0], str(tmp_path))  # qwen2: qkv bias, no qk-norm
    a.train(_samples(env[2], seed=10))
    a.save(1)
    qwen3 = str(init_tiny(tmp_path / "qwen3", arch="qwen3", seed=1, hidden_size=128, intermediate_size=256))
    b = _make(qwen3, str(tmp_path))  # same run directory, a model with qk-norm and no qkv bias
    with pytest.raises(CheckpointError) as err:
        b.load(None)
    msg = str(err.value)
    print(msg)
    assert "missing" in msg and "q_layernorm" in msg, msg
    assert "unexpected" in msg and "linear_qkv.bias" in msg, msg


def test_earlier_per_rank_format_is_refused(env, tmp_path):
    from miles.train.checkpoint import CheckpointError, mark_complete, step_dir

    b = _make(env[0], str(tmp_path))
    old = step_dir(b.plan.run_dir, 4) / "megatron"
    old.mkdir(parents=True)
    torch.save({}, old / "optim_state_tp0_pp0.pt")
    mark_complete(b.plan.run_dir, 4, keep_last=2)
    with pytest.raises(CheckpointError, match="earlier per-rank format"):
        b.load(4)


# ---------------------------------------------------------------------------------- recompute


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_step(env, tmp_path, mode):
    samples = _samples(env[2], seed=13)
    base = _make(env[0], str(tmp_path / "base"))
    rec = _make(env[0], str(tmp_path / "rec"), recompute=mode)
    assert rec.gpt.config.recompute_granularity == mode
    if mode == "selective":
        assert rec.gpt.decoder.layers[0].self_attention.checkpoint_core_attention
    before = _export(base)
    ma, mb = base.train(samples), rec.train(samples)
    print(mode, ma, mb)
    assert abs(ma["loss"] - mb["loss"]) <= 1e-6 * max(1.0, abs(ma["loss"]))
    assert abs(ma["grad_norm"] - mb["grad_norm"]) <= 1e-5 * ma["grad_norm"]
    rel = _update_rel_diff(before, _export(rec), _export(base))
    assert rel < 1e-4, f"recompute={mode} changes the update by {rel:.2e}"


# ------------------------------------------------------------------------------------ packing


def _per_sample_logprobs(b, samples, packed: bool, use_mask: bool = True) -> dict[int, torch.Tensor]:
    from miles.train.megatron import batch as B
    from miles.train.megatron import model as M

    dev = torch.device("cuda", torch.cuda.current_device())
    mbs = B.pack(samples, [0.0] * len(samples), 64, dev, packed=packed)
    out = {}
    with torch.no_grad():
        for mb in mbs:
            head = partial(B.response_head, mb=mb)
            packing = M.packed_seq_params(mb) if use_mask else None
            logits = b.model.module(
                mb.tokens, mb.positions, None, packed_seq_params=packing, output_processor=head
            )
            logp, _ = B.response_logprobs(logits, mb)
            lengths = [samples[i].response_length for i in mb.sample_ids]
            out.update(zip(mb.sample_ids, logp.float().split(lengths), strict=True))
    return out


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_packed_rows_give_the_padded_logprobs(env, tmp_path, dtype, tol):
    """fp32 runs the exact per-sequence path, bf16 the one-launch varlen flash kernel; the bf16 bound
    covers two bf16 forwards (padded flash SDPA vs varlen flash) drifting apart over the layers."""
    from miles.train.megatron import batch as B
    from miles.train.megatron.model import has_transformer_engine
    from miles.train.varlen_attention import uses_varlen_kernel

    samples = _samples(env[2], seed=17)
    dev = torch.device("cuda", torch.cuda.current_device())
    packed_mbs = B.pack(samples, [0.0] * len(samples), 64, dev, packed=True)
    assert any(len(mb.sample_ids) > 1 for mb in packed_mbs) and all(
        mb.tokens.shape[0] == 1 for mb in packed_mbs
    )
    assert B.default_packed() != has_transformer_engine(), "the backend packs unless TE attention is in"
    probe = torch.zeros(1, device=dev, dtype=getattr(torch, dtype))
    assert uses_varlen_kernel(probe) == (dtype == "bfloat16")
    b = _make(env[0], str(tmp_path), dtype=dtype)
    packed = _per_sample_logprobs(b, samples, packed=True)
    padded = _per_sample_logprobs(b, samples, packed=False)
    hf = dict(enumerate(_hf_logprobs(env[2], samples)))
    worst = 0.0
    for i in range(len(samples)):
        err = (packed[i] - padded[i]).abs().max().item()
        worst = max(worst, err)
        assert err < tol, f"sample {i}: packed and padded log-probs differ by {err:.2e}"
        if dtype == "float32":
            assert (packed[i] - hf[i].float()).abs().max().item() < 1e-3, f"sample {i}: packed vs HF"
    print(f"{dtype}: packed vs padded log-probs, largest difference {worst:.2e}")
    unmasked = _per_sample_logprobs(b, samples, packed=True, use_mask=False)
    later = [i for mb in packed_mbs for i in mb.sample_ids[1:]]
    assert any((unmasked[i] - packed[i]).abs().max() > max(1e-3, 4 * tol) for i in later), (
        "dropping the sequence offsets changes nothing: the attention ignores them"
    )


# ------------------------------------------------------------------- changed layout (2 GPUs)


def _plain_samples(seed: int, n: int = 8):
    """Samples with no rollout log-probs (the mismatch metric is not checked), same on every rank."""
    import random

    from miles.sample import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(4, 380) for _ in range(rng.randint(3, 9))]
        r = [rng.randrange(4, 380) for _ in range(rng.randint(2, 12))]
        out.append(Sample(i // 4, i % 4, p, r, [1] * len(r), [0.0] * len(r), reward=rng.random()))
    return out


def _phase(phase: str, model: str, runs: str, tp: int, pp: int) -> None:
    """`save`: train, checkpoint, train once more and record what followed; `resume`: load under this
    layout and check the weights, then that the next step repeats the recorded one."""
    import torch.distributed as dist

    torch.backends.cuda.matmul.allow_tf32 = False
    b = _make(model, runs, tensor_parallel=tp, pipeline_parallel=pp)
    expect = Path(runs) / "expect.pt"
    if phase == "save":
        b.train(_plain_samples(1))
        b.save(1, {"data_pos": 5})
        saved = _export(b)
        m = b.train(_plain_samples(2))
        after = _export(b)
        if dist.get_rank() == 0:
            torch.save({"saved": saved, "loss": m["loss"], "after": after}, expect)
        return
    assert b.load(None) == {"data_pos": 5}
    loaded = _export(b)
    m = b.train(_plain_samples(2))
    after = _export(b)
    if dist.get_rank() != 0:
        return
    ref = torch.load(expect)
    same = (
        all(torch.equal(loaded[k], ref["saved"][k]) for k in ref["saved"])
        and loaded.keys() == ref["saved"].keys()
    )
    rel = _update_rel_diff(ref["saved"], after, ref["after"])
    res = dict(tp=tp, pp=pp, weights_equal=same, loss=m["loss"], ref_loss=ref["loss"], update_rel_diff=rel)
    print("RESULT", json.dumps(res))
    assert same and abs(m["loss"] - ref["loss"]) < 1e-4 and rel < 1e-2, res


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.gpu2
@pytest.mark.parametrize(
    "saved,resumed", [((2, 1), (1, 2)), ((1, 1), (2, 1))], ids=["tp2-to-pp2", "dp2-to-tp2"]
)
def test_resume_with_another_layout(env, tmp_path, saved, resumed):
    """Saved under one TP x PP x DP layout of 2 GPUs, resumed under another: same weights, same next step."""
    runs = str(tmp_path)
    for phase, (tp, pp) in (("save", saved), ("resume", resumed)):
        proc = _torchrun(phase, env[0], runs, str(tp), str(pp))
        print(phase, proc.stdout[-2000:], proc.stderr[-4000:] if proc.returncode else "")
        assert proc.returncode == 0, f"{phase} with tp={tp} pp={pp} failed:\n{proc.stderr[-3000:]}"
    assert "RESULT" in proc.stdout


if __name__ == "__main__":
    _phase(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
