"""Trajectory trees: the token record of one session, and one training Sample per branch.

Every chat call of a session adds one node: the tokens appended for the messages the client sent
after its parent's turn (template, user and tool tokens: loss mask 0; for a first node, the whole
first prompt) and the tokens the engine produced for the reply (loss mask 1), with their log-probs
and weight versions. A node's token sequence is its parent's sequence plus its own two parts, so the
prompt of every call is the recorded tokens of the path plus the newly appended ones: what the
engine produced is never re-rendered.

A call whose history matches a node's path continues that node; a call whose history leaves the
record (an edited message, a retry, a different reply chosen among `n`) continues the deepest node it
still matches, so a node may have several children: the session forks. Each root-to-leaf path is one
branch and one Sample; branches share the tokens of their common nodes.

Sample layout of a branch: `prompt_ids` = the first node's appended tokens (the first prompt),
`response_ids` = everything after; `loss_mask` is 1 exactly on engine-produced tokens;
`rollout_logprobs` are the engine's on those and 0.0 elsewhere; `weight_versions` has one entry per
response token: the engine's version for produced tokens, and for appended tokens the version of the
reply before them (they add no new version, so `Sample.oldest_version` is that of the policy tokens).
`metadata` carries `branch`, `node_ids`, `turns` (engine calls on the branch), `tool_calls` and
`malformed_tool_calls` (counted over the branch's replies), `num_branches`, plus the session's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.sample import Sample, Status

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}

Match = Callable[[dict[str, Any], dict[str, Any]], bool]
"""`match(sent, recorded) -> bool`: whether a message the client sent is the recorded one."""


@dataclass
class Node:
    """One chat call: the messages it appended, their tokens, and the engine's reply."""

    id: int
    parent: Node | None
    messages: list[dict[str, Any]]
    """The request's messages after the parent's reply (all of them for a first node)."""
    appended_ids: list[int]
    """Tokens of `messages` plus the generation prompt (mask 0); for a first node, the prompt."""
    output_ids: list[int]
    """Tokens the engine produced, exactly as returned (mask 1)."""
    logprobs: list[float]
    versions: list[int]
    """Weight version of each output token."""
    reply: dict[str, Any]
    """The assistant message returned to the client (role, content, tool_calls, reasoning_content)."""
    finish_reason: str
    tools_key: str = ""
    """The tools and template options of the first prompt (first nodes only), as canonical JSON."""
    children: list[Node] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    def path(self) -> list[Node]:
        """The nodes from the first one down to this one."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def token_ids(self) -> list[int]:
        """The whole token sequence up to and including this node's reply."""
        ids: list[int] = []
        for n in self.path():
            ids += n.appended_ids
            ids += n.output_ids
        return ids


@dataclass
class TrajectoryTree:
    """The nodes of one session; first nodes (one per distinct first prompt) in `roots`."""

    roots: list[Node] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)

    def match(
        self, messages: list[dict[str, Any]], tools_key: str, same_input: Match, same_reply: Match
    ) -> tuple[Node | None, int]:
        """The deepest node whose path the history `messages` follows, and how many messages that
        path covers (None, 0 when no first node matches)."""
        best: Node | None = None
        pos = 0
        level = [r for r in self.roots if r.tools_key == tools_key]
        while level:
            for child in level:
                end = pos + len(child.messages)
                if end >= len(messages):
                    continue
                if not all(same_input(messages[pos + i], m) for i, m in enumerate(child.messages)):
                    continue
                if not same_reply(messages[end], child.reply):
                    continue
                best, pos, level = child, end + 1, child.children
                break
            else:
                break
        return best, pos

    def add(
        self,
        parent: Node | None,
        messages: list[dict[str, Any]],
        appended_ids: list[int],
        output_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        reply: dict[str, Any],
        finish_reason: str,
        tools_key: str = "",
    ) -> Node:
        assert len(output_ids) == len(logprobs) == len(versions), "one log-prob and version per token"
        node = Node(
            len(self.nodes),
            parent,
            list(messages),
            list(appended_ids),
            list(output_ids),
            list(logprobs),
            list(versions),
            reply,
            finish_reason,
            tools_key if parent is None else parent.path()[0].tools_key,
        )
        (self.roots if parent is None else parent.children).append(node)
        self.nodes.append(node)
        return node

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if not n.children]

    def samples(self, group_id: int = 0, metadata: dict[str, Any] | None = None) -> list[Sample]:
        """One Sample per branch (root-to-leaf path), in the order the leaves were made."""
        leaves = self.leaves()
        return [
            branch_sample(leaf, group_id, i, {**(metadata or {}), "num_branches": len(leaves)})
            for i, leaf in enumerate(leaves)
        ]

    def describe(self) -> list[dict[str, Any]]:
        """The nodes as plain data (for debugging views)."""
        return [
            {
                "id": n.id,
                "parent": None if n.parent is None else n.parent.id,
                "children": [c.id for c in n.children],
                "messages": n.messages,
                "appended_tokens": len(n.appended_ids),
                "output_tokens": len(n.output_ids),
                "finish_reason": n.finish_reason,
                "reply": n.reply,
                "versions": sorted(set(n.versions)),
            }
            for n in self.nodes
        ]


def branch_sample(leaf: Node, group_id: int, index: int, metadata: dict[str, Any]) -> Sample:
    """The Sample of the branch ending at `leaf` (layout in the module docstring)."""
    path = leaf.path()
    first = path[0]
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    version = first.versions[0] if first.versions else 0
    for i, node in enumerate(path):
        if i > 0:
            response += node.appended_ids
            mask += [0] * len(node.appended_ids)
            logprobs += [0.0] * len(node.appended_ids)
            versions += [version] * len(node.appended_ids)
        response += node.output_ids
        mask += [1] * len(node.output_ids)
        logprobs += node.logprobs
        versions += node.versions
        if node.versions:
            version = node.versions[-1]
    meta = {
        **metadata,
        "branch": index,
        "node_ids": [n.id for n in path],
        "turns": len(path),
        "tool_calls": sum(len(n.reply.get("tool_calls") or []) for n in path),
        "malformed_tool_calls": sum(int(n.reply.get("malformed_tool_calls", 0)) for n in path),
    }
    return Sample(
        group_id,
        index,
        list(first.appended_ids),
        response,
        mask,
        logprobs,
        status=FINISH_STATUS.get(leaf.finish_reason, Status.FAILED),
        weight_versions=versions,
        metadata=meta,
    )
