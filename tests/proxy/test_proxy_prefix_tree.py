"""proxy.upstream.prefix_tree: the cache-aware policy's bounded prefix tree and its prompt keys (in process)."""

from __future__ import annotations

import random

import pytest

from proxy.upstream.prefix_tree import TOKEN_IDS_MARK, PrefixTree, _Node, prompt_key

# --- insert and match ----------------------------------------------------------------------------


def test_match_counts_the_leading_characters_held() -> None:
    tree = PrefixTree(1000)
    assert tree.match("anything") == 0
    tree.insert("hello world")
    assert tree.match("hello world") == 11
    assert tree.match("hello world, and more") == 11
    assert tree.match("hello there") == 6
    assert tree.match("hel") == 3
    assert tree.match("xyz") == 0
    assert tree.match("") == 0
    assert (tree.chars, tree.leaves, tree.node_count()) == (11, 1, 1)


def test_diverging_keys_split_an_edge_and_extensions_grow_the_leaf() -> None:
    tree = PrefixTree(1000)
    tree.insert("abcdef")
    tree.insert("abcxyz")
    assert (tree.match("abcdef"), tree.match("abcxyz"), tree.match("abcq")) == (6, 6, 3)
    assert (tree.chars, tree.leaves, tree.node_count()) == (9, 2, 3)  # abc -> {def, xyz}
    tree.insert("abcxyz and the next turn")  # a conversation's next turn extends its leaf in place
    assert tree.match("abcxyz and the next turn!") == 24
    assert (tree.chars, tree.leaves, tree.node_count()) == (27, 2, 3)
    tree.insert("abc")  # a prefix of what is held: nothing new
    tree.insert("")
    assert (tree.chars, tree.leaves, tree.node_count()) == (27, 2, 3)


def test_a_key_longer_than_the_bound_is_cut_to_it() -> None:
    tree = PrefixTree(5)
    tree.insert("abcdefgh")
    assert (tree.chars, tree.match("abcdefgh")) == (5, 5)


# --- eviction --------------------------------------------------------------------------------------


def test_the_least_recently_inserted_leaf_is_evicted_first() -> None:
    tree = PrefixTree(10)
    tree.insert("aaaa")
    tree.insert("bbbb")
    tree.insert("aaaa")  # seen again: now the most recent
    tree.insert("cccc")  # 12 characters: the oldest leaf goes
    assert (tree.match("aaaa"), tree.match("bbbb"), tree.match("cccc")) == (4, 0, 4)
    assert tree.chars == 8


def test_a_key_ending_inside_an_edge_refreshes_that_leaf() -> None:
    tree = PrefixTree(12)
    tree.insert("aaaaaa")
    tree.insert("bbbbbb")
    tree.insert("aaa")  # a prefix of the first leaf: that leaf is the most recent now
    tree.insert("cc")
    assert (tree.match("aaaaaa"), tree.match("bbbbbb"), tree.match("cc")) == (6, 0, 2)


def test_eviction_merges_a_parent_left_with_one_child_and_frees_a_childless_one() -> None:
    tree = PrefixTree(12)
    tree.insert("abcdef")
    tree.insert("abcxyz")  # abc -> {def, xyz}: 9 characters
    tree.insert("qqqq")  # 13: 'def' goes, 'abc' + 'xyz' merge into one leaf
    assert (tree.match("abcdef"), tree.match("abcxyz"), tree.match("qqqq")) == (3, 6, 4)
    assert (tree.chars, tree.leaves, tree.node_count()) == (10, 2, 2)
    tree.insert("rrrrrr")  # 16: the merged leaf (oldest) goes entirely
    assert (tree.match("abcxyz"), tree.match("qqqq"), tree.match("rrrrrr")) == (0, 4, 6)
    assert (tree.chars, tree.leaves, tree.node_count()) == (10, 2, 2)


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        PrefixTree(0)


# --- a long random trace (property-style, fixed seed) ----------------------------------------------


def _paths(tree: PrefixTree) -> list[str]:
    """Every root-to-leaf string held, checking the structural invariants on the way."""
    out: list[str] = []
    chars = 0
    stack: list[tuple[_Node, str]] = [(tree.root, "")]
    while stack:
        node, prefix = stack.pop()
        if node is not tree.root:
            chars += len(node.label)
            assert node.label and node.parent is not None
            assert node.parent.children[node.label[0]] is node
            assert len(node.children) != 1, "an internal node with one child should have been merged"
        if not node.children and node is not tree.root:
            out.append(prefix)
        for child in node.children.values():
            stack.append((child, prefix + child.label))
    assert chars == tree.chars
    assert len(out) == tree.leaves
    return out


def _reference_match(paths: list[str], key: str) -> int:
    best = 0
    for path in paths:
        n = 0
        for a, b in zip(path, key, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def test_tree_stays_within_its_bound_under_a_long_random_trace() -> None:
    rng = random.Random(20240612)
    max_chars = 3000
    tree = PrefixTree(max_chars)
    alphabet = "abcd"  # few letters: many shared prefixes, splits and merges
    conversations = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(30)]
    for step in range(6000):
        index = rng.randrange(len(conversations))
        roll = rng.random()
        if roll < 0.6:  # the conversation's next turn
            conversations[index] += "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
            key = conversations[index]
        elif roll < 0.8:  # a request sharing only part of it
            base = conversations[index]
            key = base[: rng.randint(0, len(base))] + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        else:  # a new conversation (some far longer than the whole bound)
            size = rng.choice((5, 50, 500, 5000))
            conversations[index] = key = "".join(rng.choice(alphabet) for _ in range(size))
        tree.insert(key)
        assert tree.chars <= max_chars
        assert tree.match(key) == min(len(key), max_chars)  # what was just recorded is held whole
        assert len(tree._heap) <= 2 * tree.leaves + 65  # stale heap entries are compacted
        if step % 200 == 0:
            paths = _paths(tree)
            assert tree.node_count() < 2 * max(1, tree.leaves)
            for probe in (key, conversations[rng.randrange(len(conversations))], "abcdabcd"):
                assert tree.match(probe) == _reference_match(paths, probe)
    assert tree.chars > max_chars * 0.5  # eviction frees what it must, not everything


# --- prompt keys -----------------------------------------------------------------------------------


def test_a_conversations_next_turn_extends_its_key() -> None:
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    turn1 = prompt_key({"messages": history})
    history += [
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "More"}]},
    ]
    turn2 = prompt_key({"messages": history})
    assert turn2.startswith(turn1) and len(turn2) > len(turn1)
    assert "You are terse." in turn1 and "More" in turn2
    # Roles are part of the key: the same text from another role is another prompt.
    assert prompt_key({"messages": [{"role": "user", "content": "x"}]}) != prompt_key(
        {"messages": [{"role": "system", "content": "x"}]}
    )
    image = prompt_key({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    assert "<image_url>" in image


def test_completion_prompt_keys() -> None:
    assert prompt_key({"prompt": "Hello"}) == "Hello"
    assert prompt_key({"prompt": ["first", "second"]}) == "first"
    assert prompt_key({"prompt": [72, 105]}) == TOKEN_IDS_MARK + "Hi"
    assert prompt_key({"prompt": [[1, 2], [3]]}) == TOKEN_IDS_MARK + "\x01\x02"
    assert prompt_key({"prompt": [0x110000 + 65]}) == TOKEN_IDS_MARK + "A"  # folded, never an error
    assert prompt_key({"prompt_embeds": "..."}) == ""
    assert prompt_key({"prompt": []}) == ""
