"""A real engine process started with SGLang's speculative flags (`--speculative-algorithm STANDALONE
--speculative-draft-model-path DIR --speculative-num-steps 3`): /generate answers in SGLang's shape
with its speculative counters in meta_info, greedy output equal to a plain engine's, and the
server info reports the algorithm; a flag this engine cannot run is refused at start-up, naming it."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from miles.engine.process import start_engine

BODY = {"input_ids": [3, 9, 17, 5], "sampling_params": {"max_new_tokens": 16, "temperature": 0.0},
        "return_logprob": True}  # fmt: skip


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    from miles.models.tiny import init_tiny

    return str(init_tiny(tmp_path_factory.mktemp("draft") / "d", seed=1))


def test_counters_and_greedy_output(tiny_model, draft, tmp_path):
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
             "--speculative-num-steps", "3"]  # fmt: skip
    spec = start_engine(tiny_model, device="cpu", log_path=tmp_path / "spec.log", extra_args=flags)
    plain = start_engine(tiny_model, device="cpu", log_path=tmp_path / "plain.log")
    try:
        got = httpx.post(spec.url + "/generate", json=BODY, timeout=120).json()
        want = httpx.post(plain.url + "/generate", json=BODY, timeout=120).json()
        info = httpx.get(spec.url + "/get_server_info", timeout=30).json()
    finally:
        spec.stop()
        plain.stop()
    assert got["output_ids"] == want["output_ids"]
    meta = got["meta_info"]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_draft_token_num"] >= meta["spec_accept_token_num"] >= 0
    assert meta["spec_verify_ct"] <= meta["completion_tokens"]
    assert "spec_verify_ct" not in want["meta_info"]
    assert info["speculative_algorithm"] == "STANDALONE" and info["speculative_num_steps"] == 3


def test_an_algorithm_it_cannot_run_is_refused(tiny_model):
    out = subprocess.run([sys.executable, "-m", "miles.engine", "--model", tiny_model, "--device", "cpu",
                          "--speculative-algorithm", "NEXTN"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode != 0 and "use STANDALONE" in out.stderr


def test_draft_weights_arrive_by_their_prefix(tiny_model, draft, tmp_path):
    """`draft.*` tensors of a weight update (train.draft's push) load into the draft model and read
    back from it; the target's weights of the same update load as usual; greedy output stays the
    target's."""
    import shutil

    from safetensors.torch import load_file, save_file

    update = shutil.copytree(tiny_model, tmp_path / "update")
    drafted = {f"draft.{n}": t * 0.5 for n, t in load_file(f"{draft}/model.safetensors").items()}
    save_file(drafted, update / "draft.safetensors")
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
             "--speculative-num-steps", "2"]  # fmt: skip
    before, after, out = _update_and_read(tiny_model, flags, update, "draft.lm_head.weight", tmp_path)
    import torch

    torch.testing.assert_close(torch.tensor(after), torch.tensor(before) * 0.5)
    assert after != before and out["meta_info"]["spec_verify_ct"] >= 1


def _update_and_read(model, flags: list[str], update, name: str, tmp_path) -> tuple[list, list, dict]:
    """On an engine of `model` with `flags`: tensor `name` read back (its first rows) before and after a
    weight update from the directory `update` (which must succeed), and a greedy answer after it."""
    eng = start_engine(str(model), device="cpu", log_path=tmp_path / "spec.log", extra_args=flags)
    try:
        ask = {"name": name, "truncate_size": 2}
        before = httpx.post(eng.url + "/get_weights_by_name", json=ask, timeout=30).json()
        reply = httpx.post(
            eng.url + "/update_weights_from_disk", json={"model_path": str(update)}, timeout=120
        )
        after = httpx.post(eng.url + "/get_weights_by_name", json=ask, timeout=30).json()
        out = httpx.post(eng.url + "/generate", json=BODY, timeout=120).json()
    finally:
        eng.stop()
    assert reply.status_code == 200, reply.text
    return before, after, out


def test_a_lora_request_speculates_against_its_adapter(tiny_model, draft, tmp_path):
    """A request naming a LoRA adapter: the verify forward runs the target with the adapter (the
    draft is the base draft), so greedy output equals a plain engine's with the same adapter, and
    differs from the base model's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False))  # fmt: skip
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)
    peft.save_pretrained(tmp_path / "adapter")
    lora = [
        "--lora-paths",
        f"a={tmp_path / 'adapter'}",
        "--max-lora-rank",
        "4",
        "--lora-target-modules",
        "all",
    ]
    flags = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", draft,
             "--speculative-num-steps", "3"]  # fmt: skip
    spec = start_engine(tiny_model, device="cpu", log_path=tmp_path / "spec.log", extra_args=lora + flags)
    plain = start_engine(tiny_model, device="cpu", log_path=tmp_path / "plain.log", extra_args=lora)
    try:
        got = httpx.post(spec.url + "/generate", json={**BODY, "lora_path": "a"}, timeout=120).json()
        want = httpx.post(plain.url + "/generate", json={**BODY, "lora_path": "a"}, timeout=120).json()
        base_out = httpx.post(plain.url + "/generate", json=BODY, timeout=120).json()
    finally:
        spec.stop()
        plain.stop()
    assert got["output_ids"] == want["output_ids"] != base_out["output_ids"]
    assert got["meta_info"]["spec_verify_ct"] >= 1


def test_mtp_weights_arrive_by_their_checkpoint_names(tmp_path):
    """NEXTN: the MTP layer's tensors of a weight update (`model.layers.L.*`) load into the engine's
    MTP draft and read back from it by the same name; the target's weights load as usual."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from miles.models.tiny import init_tiny

    model = init_tiny(tmp_path / "m", seed=0, mtp=True)
    update = shutil.copytree(model, tmp_path / "update")
    mtp = {n: t * 0.5 for n, t in load_file(str(update / "mtp.safetensors")).items()}
    save_file(mtp, str(update / "mtp.safetensors"))
    name = next(n for n in mtp if n.endswith("eh_proj.weight"))
    flags = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"]
    before, after, out = _update_and_read(model, flags, update, name, tmp_path)
    torch.testing.assert_close(torch.tensor(after), torch.tensor(before) * 0.5)
    assert out["meta_info"]["spec_verify_ct"] >= 1
