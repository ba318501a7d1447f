"""The engine's DeepSeek-V4 (hybrid sliding / compressed-sparse / heavily-compressed attention over
per-token caches, hyper-connections, hash and sqrtsoftplus routing, swiglu_limit) against transformers'
DeepseekV4ForCausalLM on the same tiny weights (fp32): prompt log-probs within 1e-5, chunked prefill
equal to one forward, greedy continuations of 64 tokens equal to `generate` for a batch of mixed
lengths under both decode modes, prefix reuse across compression-block boundaries, routed experts."""

from __future__ import annotations

import random

import pytest
import torch

from miles.engine.deepseek_v4 import V4Decoder
from miles.engine.model import Batch, ModelSpec, load_weights
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Request, Scheduler

TOL = 1e-5
"""|engine - transformers| log-prob bound in fp32 (measured: ~1e-6)."""


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / "tiny-v4", arch="deepseek_v4", seed=1))


@pytest.fixture(scope="module")
def hf_v4(v4):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(v4, dtype=torch.float32).eval()


def _decoder(path: str) -> V4Decoder:
    return V4Decoder(ModelSpec.from_dir(path), load_weights(path), "cpu", torch.float32)


def _prompt_batch(tokens: list[int], start: int = 0, slots=None) -> Batch:
    """A one-request prefill of tokens[start:] whose context is tokens[:] in slots 1..len."""
    n = len(tokens)
    ctx = torch.arange(1, n + 1) if slots is None else slots
    pos = torch.arange(start, n)
    return Batch(
        torch.tensor(tokens[start:]),
        pos,
        ctx[start:],
        torch.arange(n - start)[None],
        pos[None],
        ctx[None],
        torch.arange(n - start),
    )


def _req(rid, prompt, max_new) -> Request:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return Request(rid=str(rid), prompt=list(prompt), params=sp, seed=0, stop_ids=frozenset())


def test_spec_reads_every_layer_kind_and_router(v4):
    spec = ModelSpec.from_dir(v4)
    m, e = spec.v4, spec.moe
    assert set(m.layer_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert m.hc_mult >= 2 and m.sliding_window == 8 and m.rope_dim == 8 and m.hash_layers == (0,)
    assert (e.scoring, e.hash_layers, e.swiglu_limit) == ("sqrtsoftplus", (0,), 10.0)
    assert e.sparse_layers == tuple(range(spec.num_layers))


def test_checkpoint_names_map_onto_transformers_own(v4, hf_v4):
    """The engine holds transformers' in-memory names: every tensor of the checkpoint (DeepSeek's
    spelling, as save_pretrained writes it) lands on one of them, and all of them are filled."""
    from miles.models.families.deepseek_v4 import hf_name

    on_disk = load_weights(v4)
    assert any(".attn.wq_a." in n for n in on_disk)  # DeepSeek's spelling on disk
    mapped = {hf_name(n) for n in on_disk}
    stacked = {n for n in hf_v4.state_dict() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert {n for n in mapped if ".experts." not in n} == {n for n in hf_v4.state_dict() if n not in stacked}
    assert (
        hf_name("mtp.0.attn.wq_a.weight") is None and hf_name("embed.weight") == "model.embed_tokens.weight"
    )


def test_prompt_logprobs_and_routes_match_transformers(v4, hf_v4):
    dec = _decoder(v4)
    dec.record_routing = True
    rng = random.Random(2)
    tokens = [rng.randrange(4, 380) for _ in range(45)]  # 5 windows, 11 CSA / 5 HCA blocks
    logits = dec.forward(_prompt_batch(tokens), dec.new_kv_pool(64))
    picked = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
        for layer in hf_v4.model.layers
    ]
    with torch.no_grad():
        ref = hf_v4(torch.tensor([tokens])).logits[0].float()
    for h in hooks:
        h.remove()
    assert (torch.log_softmax(logits, -1) - torch.log_softmax(ref, -1)).abs().max().item() <= TOL
    ours = dec.routing.long().sort(dim=-1).values
    assert torch.equal(ours, torch.stack(picked, dim=1).sort(dim=-1).values)
    table = hf_v4.model.layers[0].mlp.gate.tid2eid[
        torch.tensor(tokens)
    ]  # the hash layer: the table's experts
    assert torch.equal(ours[:, 0], table.sort(dim=-1).values)


def test_chunked_prefill_equals_one_forward(v4):
    """A prompt prefilled in three chunks (boundaries inside compression blocks and windows) leaves
    the caches and logits one forward does."""
    rng = random.Random(5)
    tokens = [rng.randrange(4, 380) for _ in range(41)]
    whole, chunked = _decoder(v4), _decoder(v4)
    ref = whole.forward(_prompt_batch(tokens), whole.new_kv_pool(64))
    pool, got = chunked.new_kv_pool(64), []
    for lo, hi in ((0, 6), (6, 19), (19, 41)):
        got.append(chunked.forward(_prompt_batch(tokens[:hi], start=lo), pool)[-1])
    assert torch.allclose(got[-1], ref[-1], atol=1e-5, rtol=0)
    assert torch.allclose(got[0], ref[5], atol=1e-5, rtol=0) and torch.allclose(
        got[1], ref[18], atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("overlap", [False, True], ids=["in_step", "step_ahead"])
def test_greedy_continuations_and_logprobs_match_transformers(v4, hf_v4, overlap):
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 380) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    sched = Scheduler(_decoder(v4), 8, 4096, overlap=overlap)
    reqs = [_req(i, p, 64) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    for r in reqs:
        n = len(r.prompt)
        with torch.no_grad():
            g = hf_v4.generate(
                torch.tensor([r.prompt]),
                attention_mask=torch.ones(1, n, dtype=torch.long),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            lp = torch.log_softmax(hf_v4(torch.tensor([r.prompt + r.output])).logits[0].float(), dim=-1)
        assert g[0, n:].tolist() == r.output
        ref = [lp[n - 1 + j, t].item() for j, t in enumerate(r.output)]
        assert max(abs(a - b) for a, b in zip(ref, r.logprobs, strict=True)) <= TOL
    # a prompt extending a finished one mid-block is served from its cached slots and continues alike
    first = max(reqs, key=lambda r: len(r.prompt))
    again = _req("again", first.prompt + first.output[:21], 10)
    sched.submit(again)
    sched.run_until_idle()
    assert again.cached_tokens >= len(first.prompt) and (len(first.prompt) + 21) % 4
    assert again.output == first.output[21:31]


def test_the_engine_takes_the_per_op_path_without_row_decode(v4):
    dec = _decoder(v4)
    sched = Scheduler(dec, 4, 256, overlap=False)
    sched._alloc_memory()
    assert sched.row_kv is None and not dec.fused and not dec.paged_decode


@pytest.mark.parametrize("flag", [["--quantization", "int4"], ["--enable-lora"]])
def test_the_server_refuses_what_it_does_not_serve_for_v4(v4, flag):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "miles.engine", "--model", v4, "--port", "0", *flag]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "DeepseekV4ForCausalLM (hybrid compressed attention) is served" in done.stderr


def _with_rope(src: str, dst, change) -> str:
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    change(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1}  # fmt: skip


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v3"])
def test_yarn_rope_equals_transformers(arch, v4, tmp_path):
    """The real checkpoints' long-context rope: YaRN on DeepSeek-V4's compressed layers and on
    DeepSeek-V3's latent attention (with its mscale on the softmax scale): prompt log-probs of a prompt
    four times the original context equal transformers'; another rope type is refused by name."""
    from transformers import AutoModelForCausalLM

    from miles.engine.fp8_weights import plain_decoder
    from miles.models.tiny import init_tiny

    if arch == "deepseek_v4":
        path = _with_rope(v4, tmp_path / "m", lambda c: c["rope_parameters"]["compress"].update(YARN))
    else:
        src = str(init_tiny(tmp_path / "v3", arch="deepseek_v3", seed=2))
        yarn = YARN | {"mscale": 1.0, "mscale_all_dim": 1.0}
        path = _with_rope(src, tmp_path / "m", lambda c: c["rope_parameters"].update(yarn))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    dec = plain_decoder(ModelSpec.from_dir(path), load_weights(path), "cpu", torch.float32)
    if arch == "deepseek_v4":  # cos and sin scaled; V3's mscale == mscale_all_dim scales its softmax instead
        assert dec.rope_scales["compress"] > 1.0 and dec.rope_scales["main"] == 1.0
    else:
        assert dec.spec.rope_scaling["rope_type"] == "yarn"
    rng = random.Random(6)
    tokens = [rng.randrange(4, 380) for _ in range(64)]
    logits = dec.forward(_prompt_batch(tokens), dec.new_kv_pool(80))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    assert (torch.log_softmax(logits, -1) - torch.log_softmax(ref, -1)).abs().max().item() <= TOL
    other = _with_rope(path, tmp_path / "o", lambda c: c["rope_parameters"].update(rope_type="longrope")
                       if arch == "deepseek_v3" else c["rope_parameters"]["compress"].update(rope_type="longrope"))  # fmt: skip
    with pytest.raises(ValueError, match=r"'longrope'"):
        ModelSpec.from_dir(other)


@pytest.mark.parametrize("layout", ["fp8_block", "fp8_row"])
def test_fp8_projections_equal_a_decoder_holding_the_fake_quant_values(v4, layout):
    """The FP8 contract on DeepSeek-V4's attention projections (q_a, q_b, kv, o_a, o_b; the compressors
    and indexer stay in the model dtype, as the checkpoints ship them): stored as FP8 pairs, the forward
    equals a plain decoder of the fake-quant values; an update keeps the scales it came with."""
    from miles.engine.fp8_weights import Fp8V4Decoder
    from miles.models.families.deepseek_v4 import hf_names
    from miles.quant.fp8 import FP8_DTYPE, fake_quant, is_quantized_name, quantize_weight, scale_name

    spec, weights = ModelSpec.from_dir(v4), hf_names(load_weights(v4))
    covered = [n for n in weights if is_quantized_name(n)]
    assert {n.split(".")[-2] for n in covered} == {"q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"}
    fp8 = Fp8V4Decoder(spec, weights, "cpu", torch.float32, layout, min_tokens=1)
    assert all(fp8.params[n].dtype == FP8_DTYPE for n in covered)
    fake = V4Decoder(spec, {n: fake_quant(w, layout) if n in covered else w for n, w in weights.items()},
                     "cpu", torch.float32)  # fmt: skip
    rng = random.Random(3)
    tokens = [rng.randrange(4, 380) for _ in range(29)]
    got = fp8.forward(_prompt_batch(tokens), fp8.new_kv_pool(64))
    assert torch.allclose(got, fake.forward(_prompt_batch(tokens), fake.new_kv_pool(64)), atol=1e-5, rtol=0)
    name = "model.layers.1.self_attn.o_a_proj.weight"
    q, s = quantize_weight(weights[name] * 0.5, layout)
    fp8.load({name: q, scale_name(name): s})
    assert torch.equal(fp8.params[scale_name(name)], s)
    assert torch.equal(fp8.params[name].view(torch.uint8), q.view(torch.uint8))


def test_a_checkpoint_in_deepseeks_fp8_spelling_loads(v4, tmp_path):
    """DeepSeek's own FP8 files name a weight's scale `NAME.scale` beside `NAME.weight`: the engine takes
    the pair under transformers' names."""
    import shutil

    from safetensors.torch import save_file

    from miles.engine.fp8_weights import build_decoder
    from miles.quant.fp8 import quantize_weight

    stored = load_weights(v4)
    name = "model.layers.2.attn.wq_b.weight"
    stored[name], stored[name.removesuffix(".weight") + ".scale"] = quantize_weight(stored[name], "fp8_block")
    shutil.copytree(v4, tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()
    save_file(stored, str(tmp_path / "m" / "model.safetensors"))
    dec = build_decoder(
        ModelSpec.from_dir(tmp_path / "m"), tmp_path / "m", "cpu", torch.float32, "fp8_block", 1
    )
    assert torch.equal(dec.params["model.layers.2.self_attn.q_b_proj.weight_scale_inv"],
                       stored["model.layers.2.attn.wq_b.scale"])  # fmt: skip
