"""DeepSeek-V4's shape beyond a decoder's common one (miles/engine/deepseek_v4.py runs it)."""

from __future__ import annotations

from dataclasses import dataclass, field

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
"""The attention kinds of DeepSeek-V4's layers (`layer_types`)."""


@dataclass(frozen=True)
class V4Spec:
    """DeepSeek-V4's shape beyond a decoder's common one, from its config.json."""

    layer_types: tuple[str, ...]
    compress_rates: dict[str, int] = field(hash=False)
    num_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: dict[str, float] = field(hash=False)
    rope: dict[str, dict] = field(hash=False)
    """Each rope kind's parameters ("main", "compress": default or yarn, miles/engine/rope.py)."""
    rope_truncate: bool
    max_positions: int
    sliding_window: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    eps: float
    hash_layers: tuple[int, ...]

    @classmethod
    def from_config(cls, cfg: dict) -> V4Spec:
        kinds = tuple(cfg["layer_types"])
        unknown = sorted(set(kinds) - {SLIDING, CSA, HCA})
        if unknown or len(kinds) != cfg["num_hidden_layers"]:
            raise ValueError(
                f"layer_types must name one of {SLIDING}, {CSA}, {HCA} per layer; got {list(kinds)}"
            )
        head_dim = int(cfg["head_dim"])
        ropes = cfg.get("rope_parameters") or {}
        theta = {}
        for kind, default in (
            ("main", cfg.get("rope_theta", 10000.0)),
            ("compress", cfg.get("compress_rope_theta", 160000.0)),
        ):
            sub = ropes.get(kind) or {}
            if sub.get("rope_type", "default") not in ("default", "yarn"):
                raise ValueError(
                    f"rope_parameters.{kind}.rope_type {sub['rope_type']!r} is not supported by the embedded "
                    "engine (default and yarn are); serve this checkpoint with engine.kind: sglang"
                )
            theta[kind] = float(sub.get("rope_theta", default))
        factor = float(
            (ropes.get("main") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.125))
        )
        mlp_kinds = cfg.get("mlp_layer_types") or ["moe"] * len(kinds)
        return cls(
            layer_types=kinds,
            compress_rates={k: int(v) for k, v in (cfg.get("compress_rates") or {}).items()},
            num_heads=int(cfg["num_attention_heads"]),
            head_dim=head_dim,
            rope_dim=int(head_dim * factor),
            rope_theta=theta,
            rope={k: dict(ropes.get(k) or {}) for k in theta},
            # transformers reads `truncate` at the top of V4's rope_parameters (not per kind)
            rope_truncate=bool(ropes.get("truncate", True)),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            sliding_window=int(cfg["sliding_window"]),
            q_lora_rank=int(cfg["q_lora_rank"]),
            o_groups=int(cfg["o_groups"]),
            o_lora_rank=int(cfg["o_lora_rank"]),
            index_n_heads=int(cfg["index_n_heads"]),
            index_head_dim=int(cfg["index_head_dim"]),
            index_topk=int(cfg["index_topk"]),
            hc_mult=int(cfg["hc_mult"]),
            hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]),
            hc_eps=float(cfg["hc_eps"]),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hash_layers=tuple(i for i, k in enumerate(mlp_kinds) if k == "hash_moe"),
        )

    def attention_names(self, i: int) -> list[str]:
        """HF names of layer i's attention tensors."""
        p = f"model.layers.{i}.self_attn."
        names = [
            p + n
            for n in (
                "q_a_proj.weight",
                "q_a_norm.weight",
                "q_b_proj.weight",
                "kv_proj.weight",
                "kv_norm.weight",
                "o_a_proj.weight",
                "o_b_proj.weight",
                "sinks",
            )
        ]
        kind = self.layer_types[i]
        compressors = (
            [] if kind == SLIDING else ["compressor."] + (["compressor.indexer."] if kind == CSA else [])
        )
        for c in compressors:
            names += [
                p + c + n for n in ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")
            ]
        if kind == CSA:
            names += [
                p + "compressor.indexer." + n for n in ("q_b_proj.weight", "scorer.weights_proj.weight")
            ]
        return names
