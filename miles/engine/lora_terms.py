"""The adapters' terms in a decoder's forward: the part of the LoRA bank (miles/engine/lora.py) that
the forward calls (`LoraBank.terms`).

`begin` sets the next forward's token slots and the scale mask; then each targeted layer adds its
adapters' term, by one of three routes:
- the per-op path (`delta`, `add`, `add_fused`): a GEMM, the mask, a GEMM-accumulate (or, on CUDA where
  the shapes fit, the A GEMM and one Triton kernel);
- a layer whose A is stacked under its weight (`stacks`, `split`): the layer's GEMM yields x W^T and
  x A^T at once and one kernel finishes;
- the same, with the adapters' term added by the kernel that reads the layer's output next
  (`fuses_next`; `rope_parts` for q/k/v, `split_silu` for gate/up).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from miles.engine.lora import LoraBank


def kernel_blocks(
    modules: dict[str, tuple[int, int]], units: dict[str, list[str]], max_rank: int, max_loras: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Column blocks of the groups and modules in `units` (key -> members) whose shapes the Triton
    kernels take (miles/engine/triton_lora.py); the LM head never."""
    from miles.engine.triton_lora import fits, member_blocks

    out = {}
    for key, members in units.items():
        outs, width_in = [modules[m][0] for m in members], modules[members[0]][1]
        blocks = member_blocks(outs) if fits(max_rank, max_loras, width_in) else None
        if blocks is not None and key != "lm_head":
            out[key] = blocks.to(device)
    return out


CONSUMERS = frozenset({"rope", "silu"})
"""The kernels that can add a stacked layer's adapters' term as they read its output (`fuses_next`). o's
and down's term is `split`'s, then the residual add and norm: on an H100 the two kernels (3.5 + 2.1 us
a layer at Qwen2.5-0.5B shapes, batch 256) took less time than one doing both (9 us; bench/RESULTS.md)."""
FUSED = frozenset({"silu"})
"""The consumers fused by default: on that H100, decode with one adapter ran at 0.84-0.85x of the base
model with q/k/v's term `split`'s before the RoPE kernel, 0.81-0.84x with it in that kernel."""


class LoraTerms:
    """The forward's adapter terms of one bank (module docstring)."""

    def __init__(self, bank: LoraBank, blocks: dict[str, torch.Tensor]) -> None:
        self.bank = bank
        self.blocks = blocks
        """Group or module (a group's members too: the per-op forward multiplies them one by one) -> the
        member of each column block, for the Triton kernels (empty: the PyTorch path everywhere)."""
        self.fuse_consumers: frozenset[str] = FUSED
        """The kernels that compute a stacked layer's adapters' term as they read its output: "silu"
        (gate/up's activation, `split_silu`), "rope" (q/k/v's RoPE and K/V store, `rope_parts`). For
        the others, `split` writes the output and the next kernel reads it (the benchmark's anchors)."""
        self.column_slot = torch.arange(bank.width, device=bank.device) // bank.max_rank
        self.tokens: torch.Tensor | None = None
        """Slot of each token of the current forward (set by the decoder), or None: no adapter at all."""
        self.order: torch.Tensor | None = None
        """The current forward's tokens by slot (miles/engine/triton_lora.py `slot_order`) for the Triton
        kernels, or None: tiles of consecutive tokens (a bank of one slot)."""
        self._mask: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}

    def begin(self, token_slots: torch.Tensor | None) -> None:
        """Set the slots of the next forward's tokens (None: no token has an adapter)."""
        self.tokens = token_slots
        if token_slots is None:
            self._mask, self.order = None, None
            return
        if self.blocks and self.bank.max_loras > 1:  # the Triton kernels' tiles take tokens by slot
            from miles.engine.triton_lora import slot_order

            self.order = slot_order(token_slots, self.bank.max_loras)
        hit = self.column_slot[None, :] == token_slots[:, None]
        self._mask = (hit.to(torch.float32) * self.bank.scale[self.column_slot][None, :]).to(self.bank.dtype)
        self._masks = {n: self._mask.repeat(1, n) for n in {len(g[2]) for g in self.bank.groups.values()}}

    def delta(self, x: torch.Tensor, module: str, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """s B (A x) of each token's adapter for HF module `module` (None: no adapter targets it);
        `rows`: which of the forward's tokens `x` holds (the LM head sees the last ones only)."""
        if self._mask is None or module not in self.bank.modules:
            return None
        mask = self._mask if rows is None else self._mask[rows]
        h = x.reshape(-1, x.shape[-1]) @ self.bank.A[module].t()
        h.mul_(mask)  # the scale of each token's slot; 0 on the other slots' columns
        return (h @ self.bank.B[module].t()).view(*x.shape[:-1], -1)

    def stacks(self, key: str) -> bool:
        """Whether the forward should run layer or group `key` as one GEMM over its weight with the A
        stacked under it, then `split`."""
        return self.tokens is not None and key in self.bank.stacked and key in self.blocks

    def split(self, both: torch.Tensor, key: str) -> torch.Tensor:
        """y = x W^T + the adapters' term of `key`, from both = [x W^T | x A^T] (one kernel)."""
        from miles.engine.triton_lora import lora_split

        b = self.bank.groups[key][1] if key in self.bank.groups else self.bank.B[key]
        return lora_split(both, b, self.blocks[key], *self._slots(), order=self.order)

    def _slots(self) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """The Triton kernels' arguments of the current forward's tokens: their slots, the slots'
        scales, the bank's rank and width (miles/engine/triton_lora.py)."""
        assert self.tokens is not None
        return self.tokens, self.bank.scale, self.bank.max_rank, self.bank.width

    def fuses_next(self, key: str, consumer: str) -> bool:
        """Whether layer or group `key` should run as one GEMM over its weight with A stacked under it,
        its adapters' term then added by `consumer`, the kernel that reads the output next ("rope" for
        q/k/v, "silu" for gate/up): `stacks`, and `consumer` is fused."""
        return consumer in self.fuse_consumers and self.stacks(key)

    def rope_parts(self, both: torch.Tensor, key: str) -> tuple[torch.Tensor, tuple]:
        """(x W^T, the `lora` argument of miles/engine/triton_fused.py's `rope_store_kv`) of q/k/v group
        `key` from both = [x W^T | x A^T]."""
        assert self.tokens is not None
        b = self.bank.groups[key][1]
        out, width = b.shape[0], self.bank.width
        return both[:, :out], (
            both[:, out : out + 3 * width],
            b,
            self.tokens,
            self.bank.scale,
            self.bank.max_rank,
            width,
        )

    def split_silu(self, both: torch.Tensor, key: str) -> torch.Tensor:
        """silu(gate) * up of gate/up group `key` from both = [x W^T | x A^T]: `split` and the
        activation in one kernel."""
        from miles.engine.triton_lora import lora_split_silu

        return lora_split_silu(both, self.bank.groups[key][1], *self._slots(), order=self.order)

    def add(self, y: torch.Tensor, x: torch.Tensor, module: str) -> bool:
        """y += the adapters' term of HF module `module` in place (a GEMM, the mask, a GEMM-accumulate);
        False when no adapter targets it."""
        if self._mask is None or module not in self.bank.modules:
            return False
        self._accumulate(y, x, self.bank.A[module], self.bank.B[module], module, self._mask)
        return True

    def add_fused(self, y: torch.Tensor, x: torch.Tensor, fused: str) -> bool:
        """y += the adapters' terms of fused layer `fused` (model.layers.N.self_attn.qkv_proj, ...) in
        two GEMMs and a mask over its members; False when no adapter targets any member."""
        group = self.bank.groups.get(fused)
        if group is None or self._mask is None:
            return False
        a, b, members = group
        self._accumulate(y, x, a, b, fused, self._masks[len(members)])
        return True

    def _accumulate(
        self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, key: str, mask: torch.Tensor
    ) -> None:
        """y += ((x a^T) * mask) b^T in place: on CUDA the A GEMM and one Triton kernel where `key` (a
        module or group) fits it, else a GEMM, the mask and a GEMM-accumulate."""
        if key in self.blocks:
            from miles.engine.triton_lora import lora_add_

            lora_add_(y, x, a, b, self.blocks[key], *self._slots(), order=self.order)
            return
        h = x.reshape(-1, x.shape[-1]) @ a.t()
        h.mul_(mask)
        y.view(-1, y.shape[-1]).addmm_(h, b.t())
