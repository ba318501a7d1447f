"""The text of the tiny coding model (`model.tiny.corpus: coding`): the procedural tasks' vocabulary
and instructions, the tokenizer's training text, and the shell text its base model is pretrained on.

`draw_task(seed, index)` draws one procedural task (miles/agentic/harbor/generate.py writes it as a
Harbor directory): `create` ("Create the file NAME.txt in /app containing WORD.") or `edit` ("Set
mode=NEW in /app/settings.txt.", the file holding `mode=OLD`). `corpus_lines` is the tokenizer's
text: instructions and the compact tool calls solving them.

`shell_text` is the other side: text a tiny base model is pretrained on (`model.tiny.pretrain_steps`),
shell sessions and comments about files and a settings file in the tasks' vocabulary, as a real base
model has read shell before it is trained as an agent. It never holds a task's instruction, the tool
calls or `/app`: what the agent makes of an instruction, and how it calls a tool, is left to RL.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ("alpha", "beta", "gamma", "delta", "notes", "todo", "data", "out")
WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "star")


@dataclass(frozen=True)
class DrawnTask:
    """One procedural task: its kind, instruction, the solution command (run in /app), the file it
    writes (`create`) and the word it wants; `old` is the mode an `edit` task starts from."""

    kind: str
    instruction: str
    solution: str
    name: str
    word: str
    old: str = ""


def draw_task(seed: int, index: int) -> DrawnTask:
    """Task `index` of `seed` (the same seed and index give the same task)."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.choice(("create", "edit"))
    if kind == "create":
        name, word = rng.choice(NAMES), rng.choice(WORDS)
        instruction = f"Create the file {name}.txt in /app containing {word}."
        return DrawnTask(kind, instruction, f"echo {word} > {name}.txt", name, word)
    old, new = rng.sample(WORDS, 2)
    instruction = f"Set mode={new} in /app/settings.txt."
    return DrawnTask(kind, instruction, f"sed -i s/^mode=.*/mode={new}/ settings.txt", "settings", new, old)


def corpus_lines(n: int, seed: int) -> list[str]:
    """Text of `n` tasks (instruction, the compact tool calls solving it, tool output) for training a
    tiny model's tokenizer (miles/models/tiny.py's `coding` corpus)."""
    lines = []
    for i in range(n):
        task = draw_task(seed, i)
        lines.append(
            f"{task.instruction} <tool_call>bash {task.solution}</tool_call> [exit code 0] "
            "<tool_call>submit</tool_call>"
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
