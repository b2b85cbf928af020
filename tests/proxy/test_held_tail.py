"""A cut stream whose last event held a token's text (proxy/request/held_tail.py): the resumed leg's prompt
ends at the client's last whole character, the held token is generated again.

With a real Router and fake backends: ``die_held`` sends tok0..tok2, its last event naming one more
token (HELD_ID) whose text it still held, and drops; ``resume_d`` continues a prompt ending in the
fake's generated ids. Without the check the resumed prompt would end in HELD_ID (the new decoder's
detokenizer then starts from the whole prompt's text, and HELD_ID's bytes never reach the client).
The tracker's bookkeeping and the choice of the end are pure code.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from proxy.request.attempt import Call
from proxy.request.held_tail import MAX_CANDIDATES, WINDOW, candidate_ends, longest_whole, window
from proxy.strategies.resume_body import StreamTracker, resume_call
from tests.support.fake_backend import GENERATED_ID_BASE, HELD_ID
from tests.support.router_rig import (
    HOST,
    Backends,
    RouterFactory,
    http_client,
    new_rid,
    records,
    request_body,
    sse_events,
)

TOKENS = [f"tok{i} " for i in range(8)]


def _detokenized(port: int) -> list[str]:
    """The request ids of the ``/detokenize`` calls the fake answered."""
    return httpx.get(f"http://{HOST}:{port}/stats", timeout=5, trust_env=False).json()["detokenized_for"]


def test_held_token_is_generated_again_not_replayed(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory(backends.ok_p, (backends.die_held, backends.resume_d), "--no-first-token-from-prefill")
    asked = len(_detokenized(backends.die_held))
    rid = new_rid("held-tail")
    body = request_body("/v1/completions", stream=True, bootstrap_room=0, stream_options={"include_usage": True})
    with http_client() as client:
        response = client.post(f"{router.url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert response.status_code == 200
    events = sse_events(response.content)
    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
    text = "".join(c["text"] for e in events[:-1] for c in json.loads(e).get("choices") or ())
    assert text == "".join(TOKENS)  # every token's text once, in order
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 8
    (resumed,) = records(backends.resume_d, rid)
    base = GENERATED_ID_BASE
    assert resumed["body"]["prompt"] == [ord("H"), ord("i"), base, base + 1, base + 2]  # not HELD_ID
    assert resumed["body"]["max_tokens"] == 5
    ids = _detokenized(backends.die_held)
    assert len(ids) > asked and rid in ids  # the cut decoder was asked (it still answers), under the request's id
    log = router.proc.log_text()
    assert f"rid={rid} " in log and "1 of the client's last token(s) had no text yet" in log


def _call() -> Call:
    return Call("/v1/completions", "r", {"prompt": "Hi", "max_tokens": 10, "stream": True}, True, 2, {})


def _event(text: str, ids: list[int], first: bool = False) -> bytes:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
    choice |= {"prompt_token_ids": [1, 2] if first else None, "token_ids": ids}
    payload = {"id": "cmpl-a", "object": "text_completion", "created": 5, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def test_only_a_merged_events_later_tokens_are_unsure() -> None:
    tracker = StreamTracker(_call())
    tracker.feed(_event("a", [7], first=True) + _event("b", [8]))
    assert (tracker.committed, tracker.unsure) == (2, 0)  # one step per event: its text is whole
    tracker.feed(_event("cd", [9, 10, 11]))  # three steps merged: the last two may be held
    assert (tracker.committed, tracker.unsure) == (5, 2)
    assert candidate_ends(tracker) == [5, 4, 3]
    tracker.feed(_event("", [12]))  # held, as before: not the client's
    assert (tracker.committed, tracker.unsure) == (5, 2)
    tracker.feed(_event("e", [13]))
    assert (tracker.committed, tracker.unsure) == (7, 0) and candidate_ends(tracker) == []


def test_the_longest_end_without_held_bytes_wins() -> None:
    tracker = StreamTracker(_call())
    tracker.feed(_event("a", [7], first=True) + _event("bc", [8, 9, 10]))
    ends = candidate_ends(tracker)
    assert ends == [4, 3, 2]
    assert window(tracker, 3) == [1, 2, 7, 8, 9]
    assert longest_whole(ends, ["ab\ufffd", "ab", "a\ufffdx"]) == 3
    assert longest_whole(ends, ["\ufffd", "\ufffd", "\ufffd"]) is None
    tracker.hold_back(3)
    call = resume_call(tracker)
    assert call is not None and call.body["prompt"] == [1, 2, 7, 8, 9] and call.body["max_tokens"] == 7
    assert tracker.unsure == 0


def test_windows_and_candidates_are_bounded() -> None:
    tracker = StreamTracker(_call())
    tracker.feed(_event("a", list(range(100, 100 + 3 * WINDOW)), first=True))
    assert len(window(tracker, tracker.committed)) == WINDOW
    assert window(tracker, tracker.committed)[-1] == 100 + 3 * WINDOW - 1
    assert len(candidate_ends(tracker)) == MAX_CANDIDATES + 1
    assert HELD_ID >= GENERATED_ID_BASE  # the fake's held token would show in a resumed prompt
