"""miles.launch.prepare: the tiny model is created once, atomically, however many submissions race."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles.config import ConfigError, resolve
from miles.launch.prepare import ensure_model, prepare_inputs


def _plan(path: Path, init: bool = True, seed: int = 0):
    return resolve({"model": {"path": str(path), "init_tiny_if_missing": init}, "run": {"seed": seed}})


WHOLE = {"config.json", "model.safetensors", "tokenizer.json"}


def _ensure(path: str) -> bool:
    """One racing submission: make sure the model exists, then say whether it sees all of it."""
    ensure_model(_plan(Path(path)))
    return WHOLE <= {p.name for p in Path(path).iterdir()}


def test_racing_submissions_create_the_model_once_and_whole(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "models" / "tiny"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        seen = pool.map(_ensure, [str(model)] * 3)
    assert seen == [True] * 3  # each saw a whole model
    assert capfd.readouterr().err.count("creating a tiny random model") == 1
    # nothing half-written left beside it: only the model and its lock file
    assert sorted(p.name for p in model.parent.iterdir()) == [".tiny.lock", "tiny"]
    stamp = (model / "model.safetensors").stat().st_mtime_ns
    ensure_model(_plan(model))  # exists: left alone
    assert (model / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_failed_creation_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import miles.models.tiny

    def broken(out_dir: Path, seed: int = 0, **_) -> Path:
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{")  # half written, then the writer dies
        raise OSError("disk full")

    monkeypatch.setattr(miles.models.tiny, "init_tiny", broken)
    model = tmp_path / "tiny"
    with pytest.raises(OSError, match="disk full"):
        ensure_model(_plan(model))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny.lock"]


def test_missing_model_without_init_names_the_key(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "absent", init=False)
    with pytest.raises(ConfigError, match="model.init_tiny_if_missing=true"):
        prepare_inputs(plan)
    # steps in a container may see a path the submit host does not: not an error there
    assert prepare_inputs(plan, local=False) == tmp_path / "absent"
    assert not (tmp_path / "absent").exists()


def test_bad_reward_is_caught_at_preparation(tmp_path: Path) -> None:
    plan = resolve({"model": {"path": str(tmp_path)}, "rollout": {"reward": "miles.rollout.rewards:nope"}})
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        prepare_inputs(plan)


def _train(tmp_path: Path, eval_section: dict) -> subprocess.CompletedProcess[str]:
    """`miles train` of a recipe with this eval section, in a process of its own (as a user runs it)."""
    recipe = {
        "run": {"runs_root": str(tmp_path / "runs")},
        "model": {"path": str(tmp_path / "model"), "init_tiny_if_missing": True},
        "eval": {"every_steps": 2, **eval_section},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    argv = [sys.executable, "-m", "miles.cli", "train", str(tmp_path / "recipe.yaml")]
    return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=120)


def test_missing_eval_dataset_is_caught_before_anything_starts(tmp_path: Path) -> None:
    missing = tmp_path / "aime-2024.jsonl"
    section = {"mode": "dedicated", "datasets": {"aime": {"source": "aime", "path": str(missing)}}}
    out = _train(tmp_path, section)
    assert out.returncode == 2, out.stderr
    assert "eval.datasets.aime" in out.stderr and str(missing) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "model").exists()  # nothing was started or written


def test_bad_external_eval_function_is_caught_before_anything_starts(tmp_path: Path) -> None:
    out = _train(tmp_path, {"mode": "external", "external_fn": "miles.eval.datasets:no_such_eval"})
    assert out.returncode == 2, out.stderr
    assert "eval.external_fn='miles.eval.datasets:no_such_eval'" in out.stderr, out.stderr
    assert "has no function 'no_such_eval'" in out.stderr and "Traceback" not in out.stderr
    out = _train(tmp_path, {"mode": "external", "external_fn": "no_such_module:fn"})
    assert out.returncode == 2 and "cannot import 'no_such_module'" in out.stderr, out.stderr


def test_eval_inputs_are_checked_only_when_evaluation_runs(tmp_path: Path) -> None:
    from miles.loop.inputs import check_inputs

    aime = {"aime": {"source": "aime", "path": str(tmp_path / "absent.jsonl")}}
    with pytest.raises(ConfigError, match="eval.datasets.aime"):
        check_inputs(resolve({"eval": {"mode": "shared", "datasets": aime}}))
    check_inputs(resolve({"eval": {"every_steps": 0, "datasets": aime}}))
    (tmp_path / "good.jsonl").write_text('{"problem": "What is 1+1?", "answer": "2"}\n')
    good = {"aime": {"source": "aime", "path": str(tmp_path / "good.jsonl")}}
    check_inputs(resolve({"eval": {"mode": "dedicated", "datasets": good}}))


def test_base_recipe_is_resolved_beside_its_recipe_and_trained_only_locally(tmp_path: Path) -> None:
    """model.base_recipe: a relative path is the naming recipe's sibling; a submission does not train
    it (an error on the submit host, a warning for a job's own filesystem); a base run that fails is a
    ConfigError naming the recipe, and leaves no model behind."""
    (tmp_path / "recipes").mkdir()
    base = tmp_path / "recipes" / "base.yaml"
    base.write_text(yaml.safe_dump({"rollout": {"reward": "no.such:reward"}}))  # its run fails at once
    recipe = tmp_path / "recipes" / "adapt.yaml"
    model = tmp_path / "models" / "base"
    recipe.write_text(yaml.safe_dump({"model": {"path": str(model), "base_recipe": "base.yaml"}}))
    plan = resolve(str(recipe), [f"run.runs_root={tmp_path / 'runs'}"])
    assert plan.model.base_recipe == str(base.resolve())
    with pytest.raises(ConfigError, match="make it first"):
        ensure_model(plan)
    assert ensure_model(plan, required=False) == model and not model.exists()
    with pytest.raises(ConfigError, match="base.yaml: its run failed"):
        ensure_model(plan, train_base=True)
    assert not model.exists() and not any(p.name.startswith(".base.tmp") for p in model.parent.iterdir())


def test_coding_corpus_tokenizer_makes_tool_calls_short_and_keeps_them_in_text(tmp_path: Path) -> None:
    """model.tiny.corpus=coding: <tool_call> / </tool_call> are single tokens that survive decoding (the
    environment parses them), and a generated task's solving call is about a dozen tokens."""
    from miles.launch.prepare import _create_tiny
    from miles.models.tiny import build_tokenizer

    cfg = resolve({"model": {"path": str(tmp_path / "m"), "tiny": {"corpus": "coding", "vocab_size": 512}}})
    _create_tiny(tmp_path / "m", cfg.model.tiny, 0)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    call = "<tool_call>bash echo dog > beta.txt</tool_call>"
    ids = tok.encode(call, add_special_tokens=False)
    assert len(ids) <= 13 and tok.convert_ids_to_tokens(ids)[0] == "<tool_call>"
    assert tok.decode(ids) == call
    default = build_tokenizer(512, 0)
    assert len(default.encode(call, add_special_tokens=False)) > 2 * len(ids)


def test_coding_tokenizer_gives_each_task_word_one_token_in_every_context() -> None:
    from miles.models.coding_corpus import NAMES, WORDS
    from miles.models.tiny import build_tokenizer

    tok = build_tokenizer(512, 0, "coding")
    for word in NAMES + WORDS:
        alone = tok.encode(word, add_special_tokens=False)
        assert len(alone) == 1, word
        for context in (f"containing {word}.", f"mode={word}/", f"echo {word} > x"):
            assert alone[0] in tok.encode(context, add_special_tokens=False), (word, context)


def test_pretrain_steps_make_a_base_that_writes_shell_and_the_text_holds_no_task(tmp_path: Path) -> None:
    """model.tiny.pretrain_steps: the model written has been trained on the coding corpus's shell text
    (its loss on unseen documents falls well below a random model's), and that text is shell only: no
    task instruction, no tool call, no /app, so the tasks themselves are left to RL."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles.launch.prepare import _create_tiny
    from miles.models.coding_corpus import draw_task, shell_text

    docs = shell_text(2000, 0)
    # "Create the file x.txt", "Set mode=y"
    instructions = {draw_task(0, i).instruction.split(" in ")[0] for i in range(200)}
    assert not any("<tool_call>" in d or "/app" in d or any(i in d for i in instructions) for d in docs)

    def loss_on_unseen(path: Path) -> float:
        tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
        enc = tok(shell_text(64, 7), return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        with torch.no_grad():
            return model(**enc, labels=labels).loss.item()

    for name, steps in (("random", 0), ("base", 150)):
        tiny = resolve({"model": {"tiny": {"corpus": "coding", "vocab_size": 512, "pretrain_steps": steps}}})
        _create_tiny(tmp_path / name, tiny.model.tiny, 0)
    random_loss, base_loss = loss_on_unseen(tmp_path / "random"), loss_on_unseen(tmp_path / "base")
    assert random_loss > 5.0 and base_loss < 1.5, (random_loss, base_loss)
    with pytest.raises(ConfigError, match="pretrain_steps"):
        resolve({"model": {"tiny": {"pretrain_steps": -1}}})
