"""The Megatron backend's side of the MTP layer's training (train.draft with NEXTN,
miles/train/mtp_training.py): the update passes' hidden states, and the embedding and LM head whole."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from miles.train.megatron import batch as B


def sink_then_head(sink, mb: B.MicroBatch, hidden_states: Tensor, **kwargs) -> Tensor:
    """GPTModel's output processor: `B.response_head`, after handing the micro-batch's final-normed
    hidden states [s, b, h] to `sink` as [b, s, h], with the micro-batch as one row (`B.one_row`)."""
    sink(B.one_row(mb), hidden_states.transpose(0, 1))
    return B.response_head(hidden_states, mb=mb, **kwargs)


def lm_weights(gpt, vocab: int) -> tuple[Tensor, Tensor]:
    """GPTModel `gpt`'s embedding and LM head, vocabulary shards gathered over the tensor-parallel group
    (a collective), cut to the HF vocabulary `vocab` (one pipeline stage: config.train.check_draft)."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    embed = gpt.embedding.word_embeddings.weight
    head = gpt.output_layer.weight if gpt.output_layer.weight is not None else embed  # tied

    def whole(w: Tensor) -> Tensor:
        w = w.detach().contiguous()
        if tp == 1:
            return w
        parts = [torch.empty_like(w) for _ in range(tp)]
        dist.all_gather(parts, w, group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts)

    return whole(embed)[:vocab], whole(head)[:vocab]
