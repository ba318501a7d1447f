"""SGLang's LoRA protocol against the embedded engine process (CPU, fp32), with adapters PEFT writes:
`lora_path` per request and per item, prompt log-probs equal to peft.PeftModel's, a mixed batch (two
adapters and the base model) equal to the three served alone, load from a path and from tensors,
replacement in place under the same name, unload, checksums, and the 400s that name what is wrong."""

from __future__ import annotations

import httpx
import pytest
import torch

from miles.engine.process import start_engine
from miles.weights.checksum import checksum
from miles.weights.tensor import serialize_inline

PROMPT = [12, 40, 7, 99, 5, 230, 61, 18, 77, 150]
OTHER = [3, 8, 15, 200, 41, 9]
TOL = 1e-4


def _adapter(tiny_model: str, out, seed: int, rank: int, targets: list[str]):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)  # visible in the log-probs
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": _adapter(tiny_model, root / "a", 1, 4, ["q_proj", "v_proj", "down_proj"]),
        "b": _adapter(
            tiny_model,
            root / "b",
            2,
            8,
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        "big": _adapter(tiny_model, root / "big", 3, 16, ["q_proj"]),
    }


@pytest.fixture(scope="module")
def engine(tiny_model, adapters, tmp_path_factory):
    args = ["--lora-paths", f"a={adapters['a']}", "--max-lora-rank", "8", "--max-loras-per-batch", "3"]
    args += ["--lora-target-modules", "all"]
    proc = start_engine(tiny_model, device="cpu", dtype="float32", extra_args=args,
                        log_path=tmp_path_factory.mktemp("lora-engine") / "engine.log")  # fmt: skip
    yield proc
    proc.stop()


def _post(engine, route: str, body: dict) -> httpx.Response:
    return httpx.post(engine.url + route, json=body, timeout=120)


def _logprobs(engine, lora, prompts=(PROMPT,)) -> list[list[float]]:
    batch = len(prompts) > 1
    body = {
        "input_ids": [list(p) for p in prompts] if batch else list(prompts[0]),
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "lora_path": lora,
    }
    resp = _post(engine, "/generate", body)
    assert resp.status_code == 200, resp.text
    out = resp.json() if batch else [resp.json()]
    return [[row[0] for row in o["meta_info"]["input_token_logprobs"][1:]] for o in out]


def _peft_logprobs(tiny_model, adapter: str | None, prompt=PROMPT) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


def test_adapter_logprobs_equal_peft(engine, tiny_model, adapters):
    got = _logprobs(engine, "a")[0]
    assert got == pytest.approx(_peft_logprobs(tiny_model, adapters["a"]), abs=TOL)
    base = _logprobs(engine, None)[0]
    assert base == pytest.approx(_peft_logprobs(tiny_model, None), abs=TOL)
    assert max(abs(x - y) for x, y in zip(got, base, strict=True)) > 10 * TOL


def test_load_from_path_mixed_batch_and_unload(engine, tiny_model, adapters):
    r = _post(engine, "/load_lora_adapter", {"lora_name": "b", "lora_path": adapters["b"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert set(r.json()["loaded_adapters"]) == {"a", "b"}
    alone = [_logprobs(engine, name, (p,))[0] for name, p in (("a", PROMPT), ("b", OTHER), (None, PROMPT))]
    mixed = _logprobs(engine, ["a", "b", None], (PROMPT, OTHER, PROMPT))
    for m, a in zip(mixed, alone, strict=True):
        assert m == pytest.approx(a, abs=1e-5)
    assert alone[1] == pytest.approx(_peft_logprobs(tiny_model, adapters["b"], OTHER), abs=TOL)
    r = _post(engine, "/unload_lora_adapter", {"lora_name": "b"})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a"}
    r = _post(
        engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "lora_path": "b"}
    )
    assert r.status_code == 400 and "'b'" in r.text and "not a loaded adapter" in r.text


def test_load_from_tensors_replaces_in_place_with_checksums(engine, tiny_model, adapters):
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    cfg = json.loads((Path(adapters["b"]) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapters["b"]) / "adapter_model.safetensors"))
    sums = {n: checksum(t) for n, t in tensors.items()}
    body = {"lora_name": "c", "config_dict": cfg, "serialized_named_tensors": [serialize_inline(list(tensors.items()))],
            "expected_checksums": sums}  # fmt: skip
    r = _post(engine, "/load_lora_adapter_from_tensors", body)
    assert r.status_code == 200, r.text
    first = _logprobs(engine, "c")[0]
    assert first == pytest.approx(_peft_logprobs(tiny_model, adapters["b"]), abs=TOL)
    stored = httpx.post(engine.url + "/weights_checker", json={"action": "checksum"}, timeout=60).json()
    reported = stored["ranks"][0]["checksums"]
    assert all(reported[f"c/{n}"] == s for n, s in sums.items())
    # the same name again: replaced in place by the new tensors
    doubled = {n: t * 2 if "lora_B" in n else t for n, t in tensors.items()}
    body["serialized_named_tensors"] = [serialize_inline(list(doubled.items()))]
    body["expected_checksums"] = {n: checksum(t) for n, t in doubled.items()}
    r = _post(engine, "/load_lora_adapter_from_tensors", body)
    assert r.status_code == 200, r.text
    second = _logprobs(engine, "c")[0]
    assert max(abs(x - y) for x, y in zip(first, second, strict=True)) > 10 * TOL
    assert _post(engine, "/unload_lora_adapter", {"lora_name": "c"}).status_code == 200


def test_bad_adapters_and_requests_are_400s_that_name_them(engine, adapters):
    r = _post(engine, "/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["big"]})
    assert r.status_code == 400 and "rank 16" in r.text and "--max-lora-rank 8" in r.text
    r = _post(engine, "/generate", {"input_ids": [PROMPT, OTHER], "sampling_params": {"max_new_tokens": 1},
                                    "lora_path": ["a", "nope"]})  # fmt: skip
    assert r.status_code == 400 and "'nope'" in r.text and "item 1" in r.text
    r = _post(engine, "/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 400 and "'nope'" in r.text


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort", None])
def test_replacing_in_place_while_requests_run_never_deadlocks(engine, adapters, mode):
    """A request decodes with adapter `a` while the adapter is replaced (as the trainer pushes each
    step), under every pause mode and without a pause: the load answers, the request ends (aborted
    only under `abort`), and the engine serves the new tensors."""
    import json
    import threading
    from pathlib import Path

    from safetensors.torch import load_file

    cfg = json.loads((Path(adapters["a"]) / "adapter_config.json").read_text())
    tensors = load_file(str(Path(adapters["a"]) / "adapter_model.safetensors"))
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 1.0},
            "lora_path": "a"}  # fmt: skip
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(reply=_post(engine, "/generate", body)))
    worker.start()
    try:
        for _ in range(500):  # until the request runs
            state = httpx.get(engine.url + "/server_info", timeout=10).json()["internal_states"][0]
            if state["num_running_reqs"] >= 1:
                break
            threading.Event().wait(0.005)
        if mode is not None:
            assert _post(engine, "/pause_generation", {"mode": mode}).status_code == 200
        push = {"lora_name": "a", "config_dict": cfg,
                "serialized_named_tensors": [serialize_inline([(n, t * 1.5) for n, t in tensors.items()])]}  # fmt: skip
        r = _post(engine, "/load_lora_adapter_from_tensors", push)
        assert r.status_code == 200, r.text
        if mode is not None:
            assert _post(engine, "/continue_generation", {}).status_code == 200
    finally:
        worker.join(timeout=120)
    assert not worker.is_alive(), "the request never finished"
    reply = result["reply"]
    assert reply.status_code == 200, reply.text
    finish = reply.json()["meta_info"]["finish_reason"]["type"]
    assert finish == ("abort" if mode == "abort" else "length")
    # put the original back for the other tests
    push["serialized_named_tensors"] = [serialize_inline(list(tensors.items()))]
    assert _post(engine, "/load_lora_adapter_from_tensors", push).status_code == 200


def test_openai_client_selects_an_adapter(engine, tiny_model):
    """The `openai` package against the engine: `model: "<base>:<adapter>"` and `extra_body.lora_path`
    give the adapter's completions; /v1/models lists the adapters under their base."""
    from openai import OpenAI

    client = OpenAI(base_url=engine.url + "/v1", api_key="none")
    models = client.models.list().data
    base = models[0].id
    assert any(m.id == "a" and getattr(m, "parent", None) == base for m in models)
    args = dict(prompt=PROMPT, max_tokens=8, temperature=0.0)
    plain = client.completions.create(model=base, **args).choices[0].text
    by_model = client.completions.create(model=f"{base}:a", **args).choices[0].text
    by_field = client.completions.create(model=base, extra_body={"lora_path": "a"}, **args).choices[0].text
    native = _post(engine, "/generate", {"input_ids": PROMPT, "lora_path": "a",
                                         "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}).json()  # fmt: skip
    assert by_model == by_field == native["text"]
    assert by_model != plain
    import openai

    with pytest.raises(openai.BadRequestError, match="nope"):
        client.completions.create(model=f"{base}:nope", **args)
