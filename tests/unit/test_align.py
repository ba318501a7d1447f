"""`miles align`: the engine and the trainer (FSDP's model) score one generation; on the same weights
they agree, and a bug planted on either side is named by module."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from miles.align import align, render


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("v3") / "m", arch="deepseek_v3", seed=1))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("q3") / "m", arch="qwen3", seed=2))


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("v4") / "m", arch="deepseek_v4", seed=1))


PROMPTS = [[5, 17, 40, 99, 12], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [200, 3]]


@pytest.mark.parametrize("which", ["qwen3", "v3", "v4"])
def test_the_same_weights_agree(which, request):
    report = align(request.getfixturevalue(which), PROMPTS, max_new=16)
    s = report.summary()
    assert s["tokens"] == 3 * 16 and s["max"] <= 1e-4
    assert report.first_divergent is None
    assert [m for m, _ in report.modules if not m.endswith("_hc")][:4] == [
        "model.layers.0.input_layernorm",
        "model.layers.0.self_attn",
        "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp",
    ]
    assert "no module beyond tolerance" in render(report)


def test_a_wrong_routed_scaling_factor_in_the_trainer_is_named(v3):
    def patch(_decoder, model):
        model.model.layers[2].mlp.gate.routed_scaling_factor = 2.0

    report = align(v3, PROMPTS, max_new=16, patch=patch)
    assert report.first_divergent == "model.layers.2.mlp"
    assert report.summary()["max"] > 1e-3
    assert "model.layers.2.mlp" in render(report).splitlines()[-1]


def _every_layer(model, attr: str, change) -> None:
    for layer in model.model.layers:
        change(getattr(layer, attr))


@pytest.mark.parametrize(
    "plant, named",
    [
        # Sinkhorn cut to its first normalisation in every hyper-connection: the first one's mixing
        # weights part (one fewer of its 20 iterations moves them by ~2e-8: converged, nothing to find)
        (
            lambda m: _every_layer(m, "attn_hc", lambda hc: setattr(hc, "hc_sinkhorn_iters", 1)),
            "model.layers.0.attn_hc",
        ),
        # the hash layer's token -> experts table permuted (AMD's first alignment bug)
        (
            lambda m: m.model.layers[0].mlp.gate.tid2eid.copy_(
                m.model.layers[0].mlp.gate.tid2eid.roll(1, dims=0)
            ),
            "model.layers.0.mlp",
        ),
        (lambda m: setattr(m.model.layers[3].mlp.gate, "routed_scaling_factor", 2.5), "model.layers.3.mlp"),
    ],
    ids=["sinkhorn", "hash_table", "scaling"],
)
def test_deepseek_v4_bugs_planted_in_the_trainer_are_named(v4, plant, named):
    report = align(v4, PROMPTS, max_new=12, patch=lambda _decoder, model: plant(model))
    assert report.first_divergent == named
    assert report.summary()["max"] > 1e-5  # the same weights agree within 1e-6


def test_a_scaled_q_norm_in_the_engine_is_named(qwen3):
    def patch(decoder, _model):
        decoder.params["model.layers.1.self_attn.q_norm.weight"].mul_(1.5)

    report = align(qwen3, PROMPTS, max_new=8, patch=patch)
    assert report.first_divergent == "model.layers.1.self_attn"


def test_a_permuted_correction_bias_shows_only_without_replay(v3):
    def patch(_decoder, model):
        gate = model.model.layers[1].mlp.gate
        gate.e_score_correction_bias.copy_(gate.e_score_correction_bias.flip(0) * 20)

    assert align(v3, PROMPTS, max_new=8, patch=patch).first_divergent is None  # R3: the engine's experts
    assert align(v3, PROMPTS, max_new=8, patch=patch, replay=False).first_divergent == "model.layers.1.mlp"


def test_the_command_prints_the_figures_on_either_trainer_side(v3, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "what is 2 plus 2?"}\nreverse the word cat\n')
    cmd = [sys.executable, "-m", "miles.cli", "align", v3, "--prompts", str(prompts), "--max-new-tokens", "6"]
    done = subprocess.run(
        cmd + ["--json", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "over 12 generated tokens" in done.stdout and "no module beyond tolerance" in done.stdout
    assert (tmp_path / "s.json").read_text().count('"max"') == 1
    from miles.models.tiny import init_tiny

    v4 = str(init_tiny(tmp_path / "v4", arch="deepseek_v4", seed=0))  # Miles' Megatron modules of V4
    mg = subprocess.run(
        [*cmd[:4], v4, *cmd[5:], "--backend", "megatron"], capture_output=True, text=True, timeout=300
    )
    assert mg.returncode == 0 and "no module beyond tolerance" in mg.stdout, mg.stdout + mg.stderr[-2000:]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    none = subprocess.run(cmd[:5] + ["--prompts", str(empty)], capture_output=True, text=True, timeout=300)
    assert none.returncode == 2 and "holds no prompt" in none.stderr


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_megatron_side_agrees_and_names_a_planted_bug(qwen3):
    """The Megatron trainer's GPTModel against the engine: agreement on the same weights, and a scaled
    pre-MLP norm on Megatron's side named by transformers' module name."""
    clean = align(qwen3, PROMPTS, max_new=8, backend="megatron")
    assert clean.summary()["max"] <= 1e-4 and clean.first_divergent is None
    assert [m for m, _ in clean.modules][:3] == [
        "model.layers.0.input_layernorm",
        "model.layers.0.self_attn",
        "model.layers.0.post_attention_layernorm",
    ]

    def patch(_decoder, gpt):
        gpt.decoder.layers[1].pre_mlp_layernorm.weight.data.mul_(1.3)

    assert align(qwen3, PROMPTS, max_new=8, backend="megatron", patch=patch).first_divergent == (
        "model.layers.1.post_attention_layernorm"
    )
