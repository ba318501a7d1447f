"""The batch-invariant operations (miles/quant/invariant.py): a token's result has the same bits
whatever the batch around it, the thread count, the padding of its context; and the plain torch ops
they replace do not have that property (so the tests can fail)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles.quant import invariant as inv


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_linear_rows_do_not_depend_on_the_batch_or_threads(gen, threads) -> None:
    w = torch.randn(384, 256, generator=gen)
    b = torch.randn(384, generator=gen)
    x = torch.randn(300, 256, generator=gen)
    torch.set_num_threads(2)
    full = inv.linear(x, w, b)
    torch.set_num_threads(1)
    for rows in ([0], [5, 6, 7], list(range(17, 90)), [299, 0, 150]):
        alone = inv.linear(x[rows], w, b)
        assert torch.equal(alone, full[rows]), rows
    # the plain GEMM gives a token other bits in another batch (what the mode exists for)
    plain = F.linear(x, w, b)
    assert any(not torch.equal(F.linear(x[i : i + 1], w, b)[0], plain[i]) for i in range(8))


def test_tree_sum_of_a_prefix_ignores_the_zeros_after_it(gen) -> None:
    x = torch.randn(4, 37, generator=gen)
    ref = inv.tree_sum(x)
    for width in (40, 64, 100, 129):
        padded = F.pad(x, (0, width - 37))
        assert torch.equal(inv.tree_sum(padded), ref)
    assert torch.allclose(ref, x.sum(-1), atol=1e-5)


def test_pointwise_exp_is_the_same_at_any_place_in_any_buffer(gen, threads) -> None:
    x = torch.randn(10_001, generator=gen) * 20
    whole = inv.pointwise(torch.exp, x)
    torch.set_num_threads(2)
    for start, stop in ((0, 7), (3, 4099), (9_990, 10_001), (1, 10_001)):
        assert torch.equal(inv.pointwise(torch.exp, x[start:stop]), whole[start:stop])


def test_rms_norm_and_rope_follow_transformers(gen) -> None:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm, apply_rotary_pos_emb

    norm = Qwen2RMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(inv.rms_norm(x, norm.weight, 1e-6), norm(x), rtol=1e-6, atol=1e-6)
    pos = torch.arange(9)
    cos, sin = inv.rope_cos_sin(pos, inv.inverse_frequencies(16, 10000.0, "cpu"), torch.float32)
    q = torch.randn(1, 2, 9, 16, generator=gen)
    want, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None])
    assert torch.equal(inv.apply_rope(q, cos[None, None], sin[None, None]), want)


def test_attention_of_a_query_is_the_same_in_decode_and_over_the_whole_sequence(gen) -> None:
    L, H, KVH, D = 23, 4, 2, 16
    q = torch.randn(1, L, H, D, generator=gen)
    k, v = torch.randn(1, L, KVH, D, generator=gen), torch.randn(1, L, KVH, D, generator=gen)
    full = inv.attention(q, k, v, torch.arange(L)[None], D**-0.5)
    want = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2), v.repeat_interleave(2, 2).transpose(1, 2),
        is_causal=True,
    ).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)
    for p in (0, 7, 15, 22):  # one query over a context padded to 32 (garbage past p), batch of three
        ctx = torch.randn(3, 32, KVH, D, generator=gen)
        kc, vc = ctx.clone(), ctx.clone() * 2
        kc[1, : p + 1], vc[1, : p + 1] = k[0, : p + 1], v[0, : p + 1]
        qd = torch.randn(3, 1, H, D, generator=gen)
        qd[1, 0] = q[0, p]
        pos = torch.tensor([[5], [p], [31]])
        out = inv.attention(qd, kc, vc, pos, D**-0.5)
        assert torch.equal(out[1, 0], full[0, p]), p


def test_token_logprobs_do_not_depend_on_the_rows_around_them(gen) -> None:
    logits = torch.randn(130, 1000, generator=gen) * 5
    tokens = torch.randint(0, 1000, (130,), generator=gen)
    full = inv.token_logprobs(logits, tokens, 0.7)
    for rows in ([0], [64, 3], list(range(60, 130))):
        assert torch.equal(inv.token_logprobs(logits[rows], tokens[rows], 0.7), full[rows])
    want = torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_the_invariant_ops(gen) -> None:
    w = torch.randn(32, 16, generator=gen, requires_grad=True)
    x = torch.randn(5, 16, generator=gen)
    logp = inv.token_logprobs(inv.silu(inv.linear(x, w)), torch.tensor([1, 2, 3, 4, 5]))
    logp.sum().backward()
    w2 = w.detach().clone().requires_grad_(True)
    torch.log_softmax(F.silu(x @ w2.t()), -1).gather(
        1, torch.tensor([[1], [2], [3], [4], [5]])
    ).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-5)


def test_attention_in_request_groups_is_the_same(gen, monkeypatch) -> None:
    q, k, v = (torch.randn(5, 2, 4, 16, generator=gen), torch.randn(5, 9, 2, 16, generator=gen),
               torch.randn(5, 9, 2, 16, generator=gen))  # fmt: skip
    pos = torch.tensor([[3, 8], [0, 1], [8, -1], [5, 6], [2, 7]])
    whole = inv.attention(q, k, v, pos, 0.25)
    monkeypatch.setattr(inv, "_KEY_BLOCK_ELEMS", 4 * 9 * 16 * 2)  # two requests a group, a query a block
    grouped = inv.attention(q, k, v, pos, 0.25)
    valid = pos >= 0
    assert torch.equal(grouped[valid], whole[valid])


def test_one_thread_blocks_in_several_threads_put_the_setting_back(threads) -> None:
    import threading
    import time

    torch.set_num_threads(2)

    def work() -> None:
        for _ in range(100):
            with inv.one_torch_thread():
                assert torch.get_num_threads() == 1
                time.sleep(0.0002)

    workers = [threading.Thread(target=work) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert torch.get_num_threads() == 2
