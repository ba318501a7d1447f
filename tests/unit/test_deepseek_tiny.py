"""Tiny DeepSeek-V3 and DeepSeek-V4 models (`miles model init-tiny --arch deepseek_v3|deepseek_v4`):
written by Miles, loaded and run by transformers' own classes, with every path of the family present."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from miles.models.families import get_family


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from miles.models.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("v3") / "m", arch="deepseek_v3", seed=1)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    out = tmp_path_factory.mktemp("v4") / "m"
    cmd = [sys.executable, "-m", "miles.cli", "model", "init-tiny", str(out), "--arch", "deepseek_v4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrote tiny deepseek_v4 model" in done.stdout
    return out


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_tiny_deepseek_v3_has_latent_attention_grouped_routing_and_a_dense_first_layer(v3) -> None:
    model = _load(v3)
    cfg = model.config
    assert type(model).__name__ == get_family("DeepseekV3ForCausalLM").hf_arch == "DeepseekV3ForCausalLM"
    attn = model.model.layers[0].self_attn
    assert (
        attn.q_a_proj is not None
        and attn.kv_a_proj_with_mqa.out_features == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    )
    assert not hasattr(model.model.layers[0].mlp, "gate")  # first_k_dense_replace = 1: a dense MLP
    sparse = [layer.mlp for layer in model.model.layers[1:]]
    assert all(m.gate.num_group > 1 and m.gate.topk_group < m.gate.num_group for m in sparse)
    assert all(m.gate.e_score_correction_bias.abs().sum() > 0 for m in sparse)  # the choice's own scores
    assert all(m.shared_experts is not None for m in sparse)
    ids = torch.randint(3, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert out.shape == (2, 48)


def test_tiny_deepseek_v4_has_every_attention_and_moe_kind(v4) -> None:
    model = _load(v4)
    cfg = model.config
    assert set(cfg.layer_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"} and cfg.hc_mult >= 2
    hashed = [
        layer.mlp.gate
        for layer, t in zip(model.model.layers, cfg.mlp_layer_types, strict=True)
        if t == "hash_moe"
    ]
    table = hashed[0].tid2eid
    assert table.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert all(len(set(row.tolist())) == cfg.num_experts_per_tok for row in table)  # k distinct experts
    assert len(set(table[:, 0].tolist())) == cfg.n_routed_experts  # every expert serves some token
    # a prompt longer than the window and several compression blocks of each compressed kind
    n = 48
    window, rates = cfg.sliding_window, cfg.compress_rates
    assert n > window and n // rates["heavily_compressed_attention"] >= 4
    ids = torch.randint(3, cfg.vocab_size, (1, n))
    with torch.no_grad():
        full = model(ids).logits
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        again = model(out[:, :n]).logits
    assert out.shape == (1, n + 8)
    assert torch.allclose(full, again)
    assert torch.isfinite(full).all()
