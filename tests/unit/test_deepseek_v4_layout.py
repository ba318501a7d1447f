"""DeepSeek-V4 checkpoints checked from their headers (miles/models/deepseek_v4_layout.py) and staged by
the launcher's prepare-checkpoint: transformers' own DeepSeek-V4 layout is accepted, with FP8 weights
and their block scales and MTP layers; another architecture, a missing tensor, an FP8 weight without
its scale or with a scale of the wrong shape are refused, naming what differs."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from miles.models.deepseek_v4_layout import LayoutError, check

LAUNCHER = Path(__file__).resolve().parents[2] / "launchers" / "deepseek_v4_flash.py"
FP8 = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_b.weight",
    ".w1.weight",
    ".w2.weight",
)


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> Path:
    from miles.models.tiny import init_tiny

    return init_tiny(tmp_path_factory.mktemp("v4") / "m", arch="deepseek_v4", seed=0)


def _fp8_copy(src: Path, dst: Path, drop_scale: str | None = None, bad_scale: str | None = None) -> Path:
    """`src` with its attention and expert weights in FP8 (128x128 block scales beside them) and an
    MTP layer, as DeepSeek's FP8 checkpoints ship."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if not name.endswith(FP8) or ".compressor." in name or ".indexer." in name:
            out[name] = t
            continue
        out[name] = t.to(torch.float8_e4m3fn)
        rows, cols = (math.ceil(d / 128) for d in t.shape)
        if name != drop_scale:
            shape = (rows + 1, cols) if name == bad_scale else (rows, cols)
            out[name.removesuffix(".weight") + ".weight_scale_inv"] = torch.ones(shape)
    out["model.mtp.0.attn.wq_a.weight"] = torch.zeros(4, 4)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_transformers_own_layout_is_accepted(v4):
    layout = check(v4)
    assert (layout.layers, layout.experts, layout.fp8, layout.mtp) == (5, 8, 0, 0)


def test_fp8_weights_with_their_scales_and_mtp_layers_are_accepted(v4, tmp_path):
    layout = check(_fp8_copy(v4, tmp_path / "fp8"))
    assert layout.fp8 > 5 * 2 * 8 and layout.mtp == 1


def test_what_differs_is_named(v4, tmp_path):
    name = "model.layers.2.attn.wq_a.weight"
    with pytest.raises(LayoutError, match=rf"FP8 weight {name} has no scale"):
        check(_fp8_copy(v4, tmp_path / "noscale", drop_scale=name))
    with pytest.raises(
        LayoutError,
        match=r"scale model.layers.2.attn.wq_a.weight_scale_inv has shape \[2, 1\], expected \[1, 1\]",
    ):
        check(_fp8_copy(v4, tmp_path / "badscale", bad_scale=name))
    cut = _fp8_copy(v4, tmp_path / "cut")
    tensors = load_file(str(cut / "model.safetensors"))
    del tensors["model.layers.3.attn.compressor.wkv.weight"]
    save_file(tensors, str(cut / "model.safetensors"))
    with pytest.raises(LayoutError, match=r"missing, e.g. \['layers.3.attn.compressor.wkv.weight'\]"):
        check(cut)


def test_another_architecture_is_refused(tmp_path):
    from miles.models.tiny import init_tiny

    path = init_tiny(tmp_path / "q", arch="qwen3_moe", seed=0)
    with pytest.raises(LayoutError, match=r"is a Qwen3MoeForCausalLM checkpoint .*not DeepseekV4ForCausalLM"):
        check(path)


def test_prepare_checkpoint_stages_a_checked_checkpoint_and_refuses_another(v4, tmp_path):
    cmd = [sys.executable, str(LAUNCHER), "prepare-checkpoint", "--src"]
    done = subprocess.run([*cmd, str(v4), "--dst", str(tmp_path / "dst")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DeepSeek-V4, 5 layers, 8 experts" in done.stdout and (tmp_path / "dst" / "config.json").is_file()
    bad = subprocess.run([*cmd, str(tmp_path), "--dst", str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode != 0 and "holds no config.json" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists()


def test_a_file_that_is_not_safetensors_is_refused(v4, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(v4, bad)
    (bad / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + b"{}")
    with pytest.raises(LayoutError, match="is not a safetensors file"):
        check(bad)
