"""The engine's DeepSeek-V3 family (multi-head latent attention over a latent cache, grouped sigmoid
routing, a shared expert) against transformers' DeepseekV3ForCausalLM on the same tiny weights (fp32):
log-probs of prompts and of every generated token within 1e-5, greedy continuations of 64 tokens equal
to `generate` for a batch of mixed lengths under both decode modes, prefix reuse, the router's experts."""

from __future__ import annotations

import json
import random

import pytest
import torch

from miles.engine.model import Batch, Decoder, ModelSpec, load_weights
from miles.engine.sampling import SamplingParams
from miles.engine.scheduler import Request, Scheduler

TOL = 1e-5
"""|engine - transformers| log-prob bound in fp32 (measured: 4.8e-7)."""


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("models") / "tiny-v3", arch="deepseek_v3", seed=1))


@pytest.fixture(scope="module")
def hf_v3(v3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(v3, dtype=torch.float32).eval()


def _hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), dim=-1)


def _req(rid, prompt, max_new) -> Request:
    sp = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return Request(rid=str(rid), prompt=list(prompt), params=sp, seed=0, stop_ids=frozenset())


def test_spec_reads_latent_attention_and_grouped_routing(v3):
    spec = ModelSpec.from_dir(v3)
    assert spec.mla is not None and spec.mla.latent_dim == 32 + 8 and spec.mla.rope_interleave
    assert spec.num_kv_heads == 1 and spec.head_dim == 8
    m = spec.moe
    assert (m.scoring, m.n_group, m.topk_group, m.routed_scaling_factor) == ("sigmoid", 4, 2, 2.5)
    assert m.sparse_layers == (1, 2) and m.shared_intermediate == 32


def test_the_pool_holds_one_latent_per_token(v3):
    dec = Decoder(ModelSpec.from_dir(v3), load_weights(v3), "cpu", torch.float32)
    pool = dec.new_kv_pool(16)
    latent, values = pool[0]
    assert latent.shape == (1, 16, 40) and values.data_ptr() == latent.data_ptr() and values.shape[-1] == 32


def test_prompt_logits_and_routing_match_transformers(v3, hf_v3):
    dec = Decoder(ModelSpec.from_dir(v3), load_weights(v3), "cpu", torch.float32)
    dec.record_routing = True
    tokens = [random.Random(2).randrange(4, 380) for _ in range(37)]
    n = len(tokens)
    ar = torch.arange(n)
    batch = Batch(ar.new_tensor(tokens), ar, ar + 1, ar[None], ar[None], (ar + 1)[None], ar)
    logits = dec.forward(batch, dec.new_kv_pool(64))
    with torch.no_grad():
        picked = []
        hooks = [
            layer.mlp.gate.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
            for layer in hf_v3.model.layers[1:]
        ]
        ref = hf_v3(torch.tensor([tokens])).logits[0].float()
        for h in hooks:
            h.remove()
    assert (torch.log_softmax(logits, -1) - torch.log_softmax(ref, -1)).abs().max().item() <= TOL
    ours = dec.routing.long().sort(dim=-1).values
    theirs = torch.stack(picked, dim=1).sort(dim=-1).values
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("overlap", [False, True], ids=["in_step", "step_ahead"])
def test_greedy_continuations_and_logprobs_match_transformers(v3, hf_v3, overlap):
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 380) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    sched = Scheduler(
        Decoder(ModelSpec.from_dir(v3), load_weights(v3), "cpu", torch.float32), 8, 4096, overlap=overlap
    )
    reqs = [_req(i, p, 64) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.submit(r)
    sched.run_until_idle()
    for r in reqs:
        n = len(r.prompt)
        with torch.no_grad():
            g = hf_v3.generate(
                torch.tensor([r.prompt]),
                attention_mask=torch.ones(1, n, dtype=torch.long),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert g[0, n:].tolist() == r.output
        lp = _hf_logprobs(hf_v3, r.prompt + r.output)
        ref = [lp[n - 1 + j, t].item() for j, t in enumerate(r.output)]
        assert max(abs(a - b) for a, b in zip(ref, r.logprobs, strict=True)) <= TOL
    # a prompt that extends a finished one is served from its cached latents and continues alike
    first = reqs[0]
    again = _req("again", first.prompt + first.output[:20], 10)
    sched.submit(again)
    sched.run_until_idle()
    assert again.cached_tokens >= len(first.prompt)
    assert again.output == first.output[20:30]


def test_latent_attention_takes_the_per_op_path_without_row_decode(v3):
    dec = Decoder(ModelSpec.from_dir(v3), load_weights(v3), "cpu", torch.float32)
    sched = Scheduler(dec, 4, 256, overlap=False)
    sched._alloc_memory()
    assert sched.row_kv is None and not dec.fused and not dec.paged_decode


@pytest.mark.parametrize("flag", [["--quantization", "int4"], ["--enable-lora"]])
def test_the_server_refuses_what_latent_attention_lacks(v3, flag):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "miles.engine", "--model", v3, "--port", "0", *flag]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "multi-head latent attention" in done.stderr and "drop the other flags" in done.stderr


@pytest.mark.parametrize("layout", ["fp8_block", "fp8_row"])
def test_fp8_latent_attention_equals_a_decoder_holding_the_fake_quant_values(v3, layout):
    """The FP8 contract on the latent attention's projections: stored as FP8 pairs, the forward equal to
    a plain decoder of the fake-quant values; an update keeps the scales it came with."""
    from miles.engine.fp8_weights import Fp8Decoder
    from miles.quant.fp8 import FP8_DTYPE, fake_quant, is_quantized_name, quantize_weight, scale_name

    spec, weights = ModelSpec.from_dir(v3), load_weights(v3)
    covered = [n for n in weights if is_quantized_name(n)]
    assert {n.split(".")[-2] for n in covered} >= {
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    }
    fp8 = Fp8Decoder(spec, weights, "cpu", torch.float32, layout, min_tokens=1)
    assert all(fp8.params[n].dtype == FP8_DTYPE for n in covered)
    fake = Decoder(
        spec,
        {n: fake_quant(w, layout) if n in covered else w for n, w in weights.items()},
        "cpu",
        torch.float32,
    )
    tokens = [random.Random(3).randrange(4, 380) for _ in range(29)]
    ar = torch.arange(len(tokens))

    def logits(dec):
        batch = Batch(ar.new_tensor(tokens), ar, ar + 1, ar[None], ar[None], (ar + 1)[None], ar)
        return dec.forward(batch, dec.new_kv_pool(64))

    assert torch.allclose(logits(fp8), logits(fake), atol=1e-5, rtol=0)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    q, s = quantize_weight(weights[name] * 0.5, layout)
    fp8.load({name: q, scale_name(name): s})
    assert torch.equal(fp8.params[scale_name(name)], s) and torch.equal(
        fp8.params[name].view(torch.uint8), q.view(torch.uint8)
    )


def test_an_fp8_checkpoint_with_fp8_experts_loads_them_dequantised(v3, tmp_path):
    """DeepSeek's FP8 checkpoints quantise the experts too: an FP8 engine serves the contract's
    projections as FP8 pairs and the experts dequantised from their own scales; an expert without its
    scale is refused by name."""
    import shutil

    from safetensors.torch import save_file

    from miles.engine.fp8_weights import build_decoder
    from miles.quant.fp8 import dequantize_weight, is_quantized_name, quantize_weight, scale_name

    spec, weights = ModelSpec.from_dir(v3), load_weights(v3)
    fp8_names = [n for n in weights if is_quantized_name(n) or (".experts." in n and n.endswith(".weight"))]
    stored, reference = dict(weights), dict(weights)
    for n in fp8_names:
        q, s = quantize_weight(weights[n], "fp8_block")
        stored[n], stored[scale_name(n)] = q, s
        reference[n] = dequantize_weight(q, s, "fp8_block", torch.float32)
    ckpt = tmp_path / "fp8"
    shutil.copytree(v3, ckpt)
    (ckpt / "model.safetensors").unlink()
    save_file(stored, str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    dec = build_decoder(spec, ckpt, "cpu", torch.float32, "fp8_block", 1)
    expert = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert dec.get(expert).dtype == torch.float32 and torch.equal(dec.get(expert), reference[expert])
    tokens = [random.Random(4).randrange(4, 380) for _ in range(21)]
    ar = torch.arange(len(tokens))

    def logits(d):
        return d.forward(
            Batch(ar.new_tensor(tokens), ar, ar + 1, ar[None], ar[None], (ar + 1)[None], ar),
            d.new_kv_pool(32),
        )

    plain = Decoder(spec, reference, "cpu", torch.float32)
    assert torch.allclose(logits(dec), logits(plain), atol=1e-5, rtol=0)
    del stored[scale_name(expert)]
    with pytest.raises(ValueError, match=f"{expert} is float8_e4m3fn but {expert}_scale_inv was not sent"):
        dec.load(stored)


def test_a_checkpoint_with_mtp_layers_loads_and_serves_the_same(v3, tmp_path):
    """Published DeepSeek-V3 checkpoints hold their multi-token-prediction layer after the decoder's
    (model.layers.61.* for 61 layers, `num_nextn_predict_layers: 1`): the engine drops it, as
    transformers does, and serves the same logits."""
    import shutil

    from safetensors.torch import save_file

    weights = load_weights(v3)
    n = ModelSpec.from_dir(v3).num_layers
    mtp = {
        k.replace("model.layers.1.", f"model.layers.{n}."): t.clone()
        for k, t in weights.items()
        if k.startswith("model.layers.1.")
    }
    mtp |= {
        f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128),
        f"model.layers.{n}.enorm.weight": torch.ones(64),
    }
    shutil.copytree(v3, tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()
    save_file(weights | mtp, str(tmp_path / "m" / "model.safetensors"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    spec = ModelSpec.from_dir(tmp_path / "m")
    assert spec.mtp_layers == 1
    rng = random.Random(4)
    tokens = [rng.randrange(4, 380) for _ in range(21)]
    ar = torch.arange(len(tokens))

    def logits(dec):
        batch = Batch(ar.new_tensor(tokens), ar, ar + 1, ar[None], ar[None], (ar + 1)[None], ar)
        return dec.forward(batch, dec.new_kv_pool(32))

    ours = Decoder(spec, load_weights(tmp_path / "m"), "cpu", torch.float32)
    plain = Decoder(ModelSpec.from_dir(v3), weights, "cpu", torch.float32)
    assert torch.equal(logits(ours), logits(plain))
