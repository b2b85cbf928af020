"""The first-token path's text against vLLM's detokenizer: the tiny model's byte-level tokenizer
and ``tokenizers.decoders.DecodeStream`` primed with the prompt's ids, as vLLM's
``FastIncrementalDetokenizer`` primes it (both vLLM lines).

One instance streams token 1, 2, ... from a stream primed with the prompt; on the first-token path
the client gets P's text of token 1 (P's stream is that same stream) and then D's texts from a
stream primed with the prompt plus token 1. Wherever :func:`text_may_be_partial` lets token 1
through, the chunks must be the same; where it does not, token 1's text was empty.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from proxy.strategies.first_token_body import text_may_be_partial

#: The tiny tokenizer's byte tokens (0-2 are its special tokens).
BYTE_IDS = range(3, 259)


def _texts(tokenizer: Tokenizer, prompt: list[int], outputs: list[int]) -> list[str]:
    """What vLLM's detokenizer returns for each output token (its reset on an invalid prefix included)."""
    stream = DecodeStream(ids=prompt, skip_special_tokens=True)
    texts = []
    for token in outputs:
        try:
            text = stream.step(tokenizer, token)
        except Exception as exc:
            if "Invalid prefix" not in str(exc):
                raise
            stream = DecodeStream(skip_special_tokens=True)
            text = stream.step(tokenizer, token)
        texts.append(text or "")
    return texts


def test_continuation_chunks_equal_one_instance_whenever_token_one_goes_first(tiny_model: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    rng = random.Random(7)
    seen = {"continued": 0, "replacement_inside": 0, "held_back": 0}
    for _ in range(3000):
        prompt = [rng.choice(BYTE_IDS) for _ in range(rng.randint(1, 40))]
        outputs = [rng.choice(BYTE_IDS) for _ in range(6)]
        one_instance = _texts(tokenizer, prompt, outputs)
        first = one_instance[0]
        if text_may_be_partial(first):
            assert first == ""  # vLLM never returns text ending inside a character
            seen["held_back"] += 1
            continue
        continuation = _texts(tokenizer, [*prompt, outputs[0]], outputs[1:])
        assert [first, *continuation] == one_instance, (prompt, outputs)
        seen["continued"] += 1
        seen["replacement_inside"] += "\ufffd" in first
    # Random bytes give every case many times: plain text, re-emitted prompt bytes with U+FFFD
    # inside token 1's text, and token 1 held back.
    assert min(seen.values()) > 100, seen
