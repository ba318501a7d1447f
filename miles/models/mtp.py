"""A multi-token-prediction (MTP) layer in DeepSeek-V3's checkpoint layout, for any decoder family.

The layer after the decoder's last (index L = num_hidden_layers, config `num_nextn_predict_layers`)
holds `model.layers.L.`:
- `enorm.weight`, `hnorm.weight`: RMSNorms of the next token's embedding and of the hidden state;
- `eh_proj.weight` [hidden, 2 * hidden]: the projection of [enorm(embed(x_{t+1})); hnorm(h_t)];
- one decoder layer of the family (its attention, MLP and two norms, under their usual names);
- `shared_head.norm.weight`: the final norm before the model's own LM head.
transformers' causal LMs leave these tensors unloaded (DeepSeek-V3's MTP layers the same way); the
engine drafts with them (miles/engine/mtp.py, `--speculative-algorithm NEXTN`).

`add_mtp_head(model_dir)` gives a model directory a freshly initialised MTP layer in a file of its
own, `mtp.safetensors` (`miles model init-tiny --mtp`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

MTP_FILE = "mtp.safetensors"
INPUT = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
"""The layer's input projection of [embedding; hidden state]."""
OWN = (*INPUT, "shared_head.norm.weight")
"""The layer's tensors beside its decoder layer (names relative to model.layers.L.)."""


def mtp_prefix(num_hidden_layers: int) -> str:
    return f"model.layers.{num_hidden_layers}."


def one_layer_config(cfg):
    """A copy of transformers config `cfg` with one decoder layer, of the MTP layer's kind (sparse
    where the family has experts): layer 0 of it is built like the MTP layer."""
    one = copy.deepcopy(cfg)
    one.num_hidden_layers = 1
    if getattr(one, "first_k_dense_replace", None):  # DeepSeek: the MTP layer is a sparse one
        one.first_k_dense_replace = 0
    if getattr(one, "mlp_only_layers", None):
        one.mlp_only_layers = []
    if isinstance(getattr(one, "layer_types", None), list):
        one.layer_types = one.layer_types[-1:]
    return one


def add_mtp_head(model_dir: str | Path, seed: int = 0) -> Path:
    """Write a random MTP layer for the model in `model_dir` (module docstring) and set
    `num_nextn_predict_layers: 1` in its config.json; returns the file written."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.models.families import family_of_model_type

    model_dir = Path(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    one = one_layer_config(cfg)
    torch.manual_seed(seed + 7919)
    layer_model = AutoModelForCausalLM.from_config(one, dtype=torch.float32)
    fill = family_of_model_type(cfg.model_type).tiny_init
    if fill is not None:
        with torch.no_grad():
            fill(layer_model, seed + 7919)
    pre, H = mtp_prefix(cfg.num_hidden_layers), cfg.hidden_size
    tensors = {
        pre + n.removeprefix("model.layers.0."): t.detach().clone().contiguous()
        for n, t in layer_model.state_dict().items()
        if n.startswith("model.layers.0.")
    }
    std = float(getattr(cfg, "initializer_range", 0.02))
    tensors[pre + "eh_proj.weight"] = torch.randn(H, 2 * H) * std
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        tensors[pre + name] = torch.ones(H)
    out = model_dir / MTP_FILE
    save_file(tensors, str(out), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
