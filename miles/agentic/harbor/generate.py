"""Procedural Harbor-format tasks small enough for a tiny model: `miles tasks generate OUT --n N`.

Two kinds, drawn per index from a seeded generator (the same seed and index give the same task):

- `create`: "Create the file NAME.txt in /app containing WORD." The tests compare the file's content
  (surrounding whitespace ignored) with WORD.
- `edit`: /app/settings.txt holds `mode=OLD`; "Set mode=NEW in /app/settings.txt." The tests
  look for the line `mode=NEW` and no `mode=OLD`.

Each task is a complete Harbor directory (task.toml, instruction.md, environment/Dockerfile, tests/test.sh,
solution/solve.sh): `miles tasks check` runs them like any other, and so would Harbor.

`shell_text` is the other side: text a tiny base model is pretrained on (`model.tiny.pretrain_steps`),
shell sessions and comments about files and a settings file in the tasks' vocabulary, as a real base
model has read shell before it is trained as an agent. It never holds a task's instruction, the tool
calls or `/app`: what the agent makes of an instruction, and how it calls a tool, is left to RL.
"""

from __future__ import annotations

import random
from pathlib import Path

NAMES = ("alpha", "beta", "gamma", "delta", "notes", "todo", "data", "out")
WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "star")

TOML = """version = "1.0"

[metadata]
generator = "miles.agentic.harbor.generate"
kind = "{kind}"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 60.0

[environment]
cpus = 1
memory_mb = 512
"""

TEST_HEAD = """#!/bin/bash
mkdir -p /logs/verifier
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _draw(seed: int, index: int) -> tuple[str, str, str, dict[str, str]]:
    """(kind, instruction, solution command run in /app, the task's other files) of task `index`."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choice(("create", "edit"))
    if kind == "create":
        name, word = rng.choice(NAMES), rng.choice(WORDS)
        instruction = f"Create the file {name}.txt in /app containing {word}."
        check = f'[ "$(tr -d "[:space:]" < /app/{name}.txt 2>/dev/null)" = "{word}" ]'
        return (
            kind,
            instruction,
            f"echo {word} > {name}.txt",
            {
                "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\n",
                "tests/test.sh": _test(check),
            },
        )
    old, new = rng.sample(WORDS, 2)
    instruction = f"Set mode={new} in /app/settings.txt."
    check = f"grep -qx 'mode={new}' /app/settings.txt && ! grep -q 'mode={old}' /app/settings.txt"
    return (
        kind,
        instruction,
        f"sed -i s/^mode=.*/mode={new}/ settings.txt",
        {
            "environment/Dockerfile": "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY settings.txt /app/settings.txt\n",
            "environment/settings.txt": f"name=demo\nmode={old}\nlevel=3\n",
            "tests/test.sh": _test(check),
        },
    )


def _test(check: str) -> str:
    return (
        TEST_HEAD
        + f"if {check}; then\n  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n"
    )


def make_task(out: Path, seed: int, index: int) -> Path:
    """Write task `index` of `seed` into out/<kind>-<index> and return its directory."""
    kind, instruction, solution, files = _draw(seed, index)
    root = out / f"{kind}-{index:04d}"
    files = {
        "instruction.md": instruction + "\n",
        "solution/solve.sh": f"#!/bin/bash\n{solution}\n",
        **files,
    }
    _write(root, {"task.toml": TOML.format(kind=kind), **files})
    return root


def corpus_lines(n: int, seed: int) -> list[str]:
    """Text of `n` tasks (instruction, the compact tool calls solving it, tool output) for training a
    tiny model's tokenizer (miles/models/tiny.py's `coding` corpus)."""
    lines = []
    for i in range(n):
        _, instruction, solution, _ = _draw(seed, i)
        lines.append(
            f"{instruction} <tool_call>bash {solution}</tool_call> [exit code 0] <tool_call>submit</tool_call>"
        )
    return lines


# comments above a command in shell_text, in phrasings other than the tasks' instructions
FILE_COMMENTS = (
    "{name}.txt holds {word}",
    "put {word} in {name}.txt",
    "write {word} into the file {name}.txt",
    "{name}.txt should say {word}",
    "a file {name}.txt with {word} in it",
    "save the word {word} as {name}.txt",
    "make {name}.txt contain {word}",
    "new file {name}.txt, content: {word}",
    "the file {name}.txt with the text {word}",
    "{name}.txt gets the word {word}",
    "fill {name}.txt with {word}",
)
MODE_COMMENTS = (
    "mode {word}",
    "change the mode to {word}",
    "mode should be {word} in settings.txt",
    "switch settings.txt to mode={word}",
    "use mode={word}",
    "in settings.txt the mode becomes {word}",
    "settings.txt: mode={word}",
)


# other words of comments: a comment of random words around the name and the word (shell_text) makes
# the word the thing to copy wherever it stands, whatever words precede it
FILLER = ("the", "a", "with", "and", "then", "only", "here", "text", "line", "value", "as", "to", "of",
          "is", "new", "first", "keep", "file", "for", "into")  # fmt: skip

# what a comment may end with (nothing, twice as often as each tail), so that a word is copied from
# wherever it stands in a sentence
COMMENT_TAILS = ("", "", " in /tmp", " in /srv/data", " in this directory", " now", " for the test")


def _comment(rng: random.Random, phrase: str) -> str:
    text = phrase + rng.choice(COMMENT_TAILS)
    if rng.random() < 0.5 and not text.startswith(NAMES + WORDS):  # a name or word keeps its case
        text = text[0].upper() + text[1:]
    return "# " + text + ("." if rng.random() < 0.5 else "")


def shell_text(n: int, seed: int) -> list[str]:
    """`n` short shell documents (module docstring): sessions that write, read and edit files, and
    commands under a comment saying what they do."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        word, other = rng.sample(WORDS, 2)
        name = rng.choice(NAMES)
        echo, cat = f"$ echo {word} > {name}.txt", f"$ cat {name}.txt"
        sed = f"$ sed -i s/^mode=.*/mode={word}/ settings.txt"
        if rng.random() < 0.3:
            words = [*rng.sample(FILLER, 3), f"{name}.txt", word]
            rng.shuffle(words)
            file_comment = _comment(rng, " ".join(words))
        else:
            file_comment = _comment(rng, rng.choice(FILE_COMMENTS).format(name=name, word=word))
        mode_comment = _comment(rng, rng.choice(MODE_COMMENTS).format(word=word))
        docs.append(
            rng.choice(
                (
                    f"{echo}\n{cat}\n{word}",
                    f"$ ls\n{name}.txt\n{cat}\n{word}",
                    f"{cat}\n{other}\n{echo}\n{cat}\n{word}",
                    f"{file_comment}\n{echo}",
                    f"$ cat settings.txt\nmode={other}\n{sed}\n$ cat settings.txt\nmode={word}",
                    f"{mode_comment}\n{sed}",
                )
            )
        )
    return docs


def generate(out: str | Path, n: int, seed: int = 0, start: int = 0) -> list[Path]:
    """Tasks start .. start + n - 1 of `seed` under `out` (a dataset folder)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return [make_task(out, seed, i) for i in range(start, start + n)]
