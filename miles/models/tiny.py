"""Write a tiny random-initialised causal LM and a locally trained tokenizer with a chat template.

The result is an ordinary Hugging Face directory (config.json, model.safetensors, tokenizer.json),
loadable by transformers' Auto classes, used by tests and by the default CPU run. Digits are single
tokens so that arithmetic tasks have one token per digit. Nothing is downloaded.

The `coding` corpus (`model.tiny.corpus`) trains the BPE on text of the procedural coding tasks
(miles/models/coding_corpus.py: their instructions, shell commands and compact tool calls) beside
the default text, makes `<tool_call>` and `</tool_call>` single tokens, as real chat models'
tokenizers do, and keeps spaces as tokens of their own, so that a word is one and the same token in
an instruction and in a command (`containing red`, `mode=red`): a tool call of such a task is then
about fifteen tokens instead of forty.

`pretrain_steps` > 0 makes a base model instead of a random one: that many causal-LM steps (AdamW,
batches of 32 documents) on the corpus's base text before the model is written. For `coding` that is
shell sessions and comments (coding_corpus.py's `shell_text`, never a task's instruction or a tool call), so
that RL starts, as it does with real models, from a model that has read some shell: a random model
of this size needs thousands of examples before it copies a word from its prompt into its answer.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from miles.models import save_modes
from miles.models.families import FAMILIES, family_of_model_type

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

_WORDS = (
    "the a an of to and in is was for on with as by at from it that this be are what which how many "
    "sum add plus minus times answer question compute number digit result equals total reverse copy "
    "count letters word sequence next value solve find list sort first last find user assistant system "
    "you are helpful think step please give only final"
).split()

ARCHS = {f.model_type: f.config_class for f in FAMILIES.values()}
"""`--arch` values: the model types of the registered families (miles/models/families/)."""
# the tiny mixture-of-experts shape: 4 experts, top-2, the first layer dense
MOE_DEFAULTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0])


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        nums = [str(rng.randint(0, 999)) for _ in range(rng.randint(0, 3))]
        ops = rng.choice(["+", "-", "*", "=", "?", ".", ",", ":", "(", ")"])
        lines.append(" ".join(words + nums) + ops)
    return lines


TOOL_TOKENS = ["<tool_call>", "</tool_call>"]


def _coding_corpus(n_lines: int, seed: int) -> list[str]:
    from miles.models.coding_corpus import corpus_lines

    return corpus_lines(n_lines, seed)


def base_text(corpus: str, n_docs: int, seed: int) -> list[str]:
    """Documents a base model of `corpus` is pretrained on (module docstring)."""
    if corpus == "coding":
        from miles.models.coding_corpus import shell_text

        return shell_text(n_docs, seed)
    return _corpus(n_docs, seed)


def _length_batches(encoded: list[list[int]], batch: int, rng: random.Random, pool: int = 16):
    """Endless batches of `batch` documents of similar length: `pool` batches' worth drawn at random,
    sorted by length, cut into batches and shuffled; a batch pads to its longest document, so this
    spends about 1.05 positions per token where random batches of the coding text spend 1.5."""
    while True:
        drawn = sorted(rng.sample(encoded, batch * pool), key=len)
        cut = [drawn[i : i + batch] for i in range(0, len(drawn), batch)]
        rng.shuffle(cut)
        yield from cut


def pretrain(
    model, tok, docs: list[str], steps: int, seed: int, lr: float = 3e-3, batch: int = 32, report=None
) -> float:
    """`steps` causal-LM steps on batches of `batch` documents of `docs` drawn with `seed` (of similar
    length: `_length_batches`), each document a row of its own from position 0, right-padded to the
    batch's longest; returns the last batch's loss. The documents are tokenised once.
    `report(step, loss)` is called after every step (progress for the console)."""
    import torch

    encoded = tok(docs)["input_ids"]
    batches = _length_batches(encoded, batch, random.Random(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        rows = next(batches)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if report is not None:
            report(step, loss.item())
    model.eval()
    return loss.item()


def build_tokenizer(vocab_size: int = 384, seed: int = 0, corpus: str = "default"):
    """A byte-level BPE tokenizer with single-digit tokens and a ChatML template (`corpus`: module
    docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if corpus not in ("default", "coding"):
        raise ValueError(f"tiny tokenizer corpus {corpus!r}: use default or coding")
    coding = corpus == "coding"
    tok = Tokenizer(models.BPE())
    # coding: spaces are tokens of their own, so a word is the same token after a space, '=' or '/'
    spaces = [pre_tokenizers.Split(" ", behavior="isolated")] if coding else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            *spaces,
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _corpus(4000, seed) + (_coding_corpus(4000, seed) if coding else [])
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    if coding:  # plain added tokens: kept when decoding, where the environment parses the call
        fast.add_tokens(TOOL_TOKENS)
    return fast


# Qwen2.5-0.5B's shapes, vocabulary and special ids: the random-init model of the GPU benchmarks.
QWEN25_05B_SHAPE = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
)
QWEN25_VOCAB, QWEN25_EOS, QWEN25_PAD = 151936, 151645, 151643


def model_config(arch: str, vocab_size: int, eos_id: int, pad_id: int, **sizes: int):
    """A transformers config of the given family with tiny default sizes (overridable)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")
    dims = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    family = family_of_model_type(arch)
    if family.tiny:  # the family's own tiny shape (DeepSeek: latent ranks, expert groups, layer kinds)
        dims.update(family.tiny)
    elif family.moe:
        dims.update(MOE_DEFAULTS, norm_topk_prob=True)
    dims.update(sizes)
    extra = {"head_dim": dims["hidden_size"] // dims["num_attention_heads"]} if family.qk_norm else {}
    cls = getattr(transformers, ARCHS[arch])
    return cls(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        **(extra | dims),  # an explicit head_dim in `sizes` wins
    )


def init_tiny(
    out_dir: str | Path,
    arch: str = "qwen2",
    seed: int = 0,
    vocab_size: int = 384,
    corpus: str = "default",
    pretrain_steps: int = 0,
    report=None,
    mtp: bool = False,
    **sizes: int,
) -> Path:
    """Create the tiny model directory (fp32 safetensors + tokenizer), random or, with
    `pretrain_steps`, a base (module docstring; `report(step, loss)`: its progress); returns its path.
    `mtp`: with a random multi-token-prediction layer (miles/models/mtp.py) for NEXTN speculation."""
    tok = build_tokenizer(vocab_size, seed, corpus)
    cfg = model_config(arch, len(tok), tok.eos_token_id, tok.pad_token_id, **sizes)
    base = None
    if pretrain_steps:
        docs = base_text(corpus, 20_000, seed)
        base = functools.partial(pretrain, tok=tok, docs=docs, steps=pretrain_steps, seed=seed, report=report)
    out = _write(Path(out_dir), cfg, tok, seed, "float32", "cpu", base)
    if mtp:
        from miles.models.mtp import add_mtp_head

        add_mtp_head(out, seed)
    return out


def _write(out: Path, cfg, tok, seed: int, dtype: str, device: str, before_save=None) -> Path:
    """Random-initialise `cfg` (seeded), apply `before_save` to the model if given, and save it with
    the tokenizer as an HF model directory."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    tiny_init = family_of_model_type(cfg.model_type).tiny_init
    if tiny_init is not None:
        with torch.no_grad():
            tiny_init(model, seed)
    if before_save is not None:
        before_save(model)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    save_modes(out)
    return out


def init_random(
    out_dir: str | Path,
    shape: dict[str, int] | None = None,
    vocab_size: int = QWEN25_VOCAB,
    tie_word_embeddings: bool = True,
    dtype: str = "bfloat16",
    seed: int = 0,
    arch: str = "qwen2",
) -> Path:
    """A random-initialised model of real size (default: Qwen2 with Qwen2.5-0.5B shapes) with the tiny
    tokenizer; `arch` is a key of ARCHS (qwen3_moe: `shape` may also set the MoE keys of MOE_DEFAULTS).

    For GPU benchmarks and tests: the tokenizer knows only its few hundred ids, the model all
    `vocab_size`; ids the tokenizer lacks decode to nothing. Built on the GPU when there is one.
    """
    import torch

    tok = build_tokenizer(384, seed)
    cfg = model_config(arch, vocab_size, tok.eos_token_id, tok.pad_token_id, **(shape or QWEN25_05B_SHAPE))
    cfg.tie_word_embeddings = tie_word_embeddings
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, 4096)
    return _write(Path(out_dir), cfg, tok, seed, dtype, "cuda" if torch.cuda.is_available() else "cpu")
