"""A decoder's 5xx before the first byte (D's KV load failed, e.g. its prefiller went silent) makes
the retry avoid the attempt's prefiller too, where another one exists."""

from __future__ import annotations

import httpx

from tests.support.router_rig import Backends, RouterFactory, http_client, new_rid, records, request_body


def test_a_decoder_5xx_retries_on_the_other_prefiller(backends: Backends, router_factory: RouterFactory) -> None:
    router = router_factory((backends.ok_p, backends.ok_p2), backends.fail500, "--max-retries", "2")
    rid = new_rid("d500-other-p")
    with http_client() as client:
        response: httpx.Response = client.post(
            f"{router.url}/v1/completions",
            json=request_body("/v1/completions", bootstrap_room=0),  # room 0: the first prefiller
            headers={"X-Request-Id": rid},
        )
    assert response.status_code == 500, response.text
    first, second = (records(port, rid) for port in router.prefill_ports)
    assert len(first) == 1 and first[0]["body"]["kv_transfer_params"]["bootstrap_room"] == 0
    assert len(second) == 1, "the retry went to the same prefiller"
    assert len(records(router.decode_port, rid)) == 2
