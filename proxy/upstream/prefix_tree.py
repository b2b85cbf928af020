"""An approximate, bounded prefix tree of the prompts one prefill instance recently prefilled.

Used by the ``cache-aware`` routing policy (:class:`proxy.upstream.routing.CacheAware`), one tree per
prefiller: it mirrors, roughly, what that instance's prefix cache may still hold, in prompt
characters (no tokenizer in the Router). :func:`prompt_key` turns a request body into the
string the tree stores: a completions prompt as is, token ids one character per id, a chat
request as its messages rendered in order (so a conversation's next turn, which resends the
history, extends the previous turn's key).

The tree is a radix tree (edges labelled with strings, children keyed by their first
character) holding at most ``max_chars`` characters of labels in all. Every internal node but
the root has at least two children (a key that extends a leaf extends that leaf's label), so
nodes are fewer than twice the leaves. Eviction is LRU by leaf: each insertion stamps the
nodes on its path with a logical clock; while the tree holds more than ``max_chars``
characters the leaf with the oldest stamp is dropped (a parent left with no child becomes a
leaf; one left with one child is merged with it). Leaves wait in a heap with lazy deletion,
rebuilt when stale entries outnumber the leaves, so the work per call is O(len(key))
(amortized: a character is evicted at most once per insertion).

Nothing here imports from :mod:`proxy`.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

#: First character of a token-id prompt's key (keeps ids apart from text that looks alike).
TOKEN_IDS_MARK = "\x00"
#: Separators of a chat request's rendering: after each role, after each message.
_ROLE_END = "\x1f"
_MESSAGE_END = "\x1e"
_CHR_LIMIT = 0x110000


def _ids_key(ids: list[Any]) -> str:
    try:
        return TOKEN_IDS_MARK + "".join(map(chr, ids))
    except (TypeError, ValueError):  # an id past the Unicode range (or not an int): fold it
        return TOKEN_IDS_MARK + "".join(chr(i % _CHR_LIMIT) if isinstance(i, int) else "?" for i in ids)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    parts = []
    for part in content:
        if isinstance(part, dict):
            text = part.get("text")
            parts.append(text if isinstance(text, str) else f"<{part.get('type')}>")
    return "".join(parts)


def prompt_key(body: Mapping[str, Any]) -> str:
    """The prompt of a completion or chat request body as the tree's key ("" if there is none).

    ``prompt``: a string as is; token ids as :data:`TOKEN_IDS_MARK` plus one character per id; a
    batch (a list of strings or of id lists): its first prompt. ``messages``: each message's role
    and text content, in order, with separators (non-text parts count as their type).
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        rendered = []
        for message in messages:
            if isinstance(message, dict):
                text = _content_text(message.get("content"))
                rendered.append(f"{message.get('role')}{_ROLE_END}{text}{_MESSAGE_END}")
        return "".join(rendered)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return _ids_key(first)
        return _ids_key(prompt)
    return ""


class _Node:
    __slots__ = ("label", "children", "parent", "stamp")

    def __init__(self, label: str, parent: _Node | None, stamp: int) -> None:
        self.label = label
        self.children: dict[str, _Node] = {}
        #: ``None`` once the node left the tree (its heap entries are then stale).
        self.parent = parent
        self.stamp = stamp


def _common_length(key: str, pos: int, label: str) -> int:
    """Length of the common prefix of ``key[pos:]`` and ``label`` (binary search on C-speed compares)."""
    low, high = 0, min(len(label), len(key) - pos)
    while low < high:
        mid = (low + high + 1) // 2
        if key.startswith(label[:mid], pos):
            low = mid
        else:
            high = mid - 1
    return low


class PrefixTree:
    """The prompts one instance recently saw, at most ``max_chars`` characters (LRU by leaf)."""

    def __init__(self, max_chars: int) -> None:
        if max_chars < 1:
            raise ValueError(f"max_chars must be at least 1 (got {max_chars})")
        self.max_chars = max_chars
        self.root = _Node("", None, 0)
        #: Characters held (the sum of every node's label length).
        self.chars = 0
        self.leaves = 0
        self._clock = 0
        self._heap: list[tuple[int, int, _Node]] = []
        self._seq = 0

    def match(self, key: str) -> int:
        """How many leading characters of ``key`` the tree holds (it is not changed)."""
        _, pos, child = self._descend(key)
        return pos if child is None else pos + _common_length(key, pos, child.label)

    def insert(self, key: str) -> None:
        """Record ``key`` (its first ``max_chars`` characters) as just seen; evict beyond the bound."""
        key = key[: self.max_chars]
        end = len(key)
        node, pos, child = self._descend(key)
        if child is not None:
            common = _common_length(key, pos, child.label)
            if pos + common == end:  # the key ends inside this edge
                node, pos = child, end
            else:
                node = self._split(child, common)
                pos += common
        if pos < end:
            node = self._add_tail(node, key[pos:])
        self._clock += 1
        self._touch(node, self._clock)
        self._evict()

    def node_count(self) -> int:
        """Nodes in the tree, the root excluded (walks the whole tree: for tests and checks)."""
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += len(node.children)
            stack.extend(node.children.values())
        return count

    # -- structure -------------------------------------------------------------------------

    def _descend(self, key: str) -> tuple[_Node, int, _Node | None]:
        """Follow the edges ``key`` covers whole: the node reached, the characters matched, and the
        child whose edge ``key`` enters without covering it (``None`` if no edge goes on)."""
        node, pos, end = self.root, 0, len(key)
        while pos < end:
            child = node.children.get(key[pos])
            if child is None:
                break
            if not key.startswith(child.label, pos):
                return node, pos, child
            pos += len(child.label)
            node = child
        return node, pos, None

    def _add_tail(self, node: _Node, tail: str) -> _Node:
        """Hang ``tail`` below ``node``; return the leaf holding it."""
        self.chars += len(tail)
        if node is not self.root and not node.children:
            node.label += tail  # a leaf extended: it stays one leaf
            return node
        leaf = _Node(tail, node, 0)
        node.children[tail[0]] = leaf
        self.leaves += 1
        return leaf

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` characters; return the new node in between."""
        parent = child.parent
        assert parent is not None
        middle = _Node(child.label[:at], parent, child.stamp)
        child.label = child.label[at:]
        child.parent = middle
        middle.children[child.label[0]] = child
        parent.children[middle.label[0]] = middle
        return middle

    def _touch(self, node: _Node, stamp: int) -> None:
        """Stamp ``node`` and its ancestors as just used; a leaf (re-)enters the eviction heap."""
        if node is self.root:
            return
        if not node.children:
            node.stamp = stamp
            self._push(node)
        while node is not self.root:
            node.stamp = stamp
            parent = node.parent
            assert parent is not None
            node = parent

    # -- eviction --------------------------------------------------------------------------

    def _push(self, leaf: _Node) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (leaf.stamp, self._seq, leaf))
        if len(self._heap) > 2 * self.leaves + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        entries: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if child.children:
                    stack.append(child)
                else:
                    self._seq += 1
                    entries.append((child.stamp, self._seq, child))
        heapq.heapify(entries)
        self._heap = entries

    def _evict(self) -> None:
        while self.chars > self.max_chars and self._heap:
            stamp, _, leaf = heapq.heappop(self._heap)
            parent = leaf.parent
            if parent is None or leaf.children or leaf.stamp != stamp:
                continue  # stale: evicted, grown into an internal node, or touched since
            del parent.children[leaf.label[0]]
            leaf.parent = None
            self.chars -= len(leaf.label)
            self.leaves -= 1
            if parent is self.root:
                continue
            if not parent.children:
                self.leaves += 1
                self._push(parent)
            elif len(parent.children) == 1:
                self._merge(parent)

    def _merge(self, node: _Node) -> None:
        """Fold ``node`` (not the root, one child left) into that child."""
        (only,) = node.children.values()
        grand = node.parent
        assert grand is not None
        only.label = node.label + only.label
        only.parent = grand
        grand.children[node.label[0]] = only
        node.parent = None
        node.children = {}
