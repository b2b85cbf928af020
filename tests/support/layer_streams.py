"""Layer-wise push driven by hand: a P side in transfer mode "layer" and the save_kv_layer calls of
one forward pass, as vLLM's worker makes them (tests/support/transfer_rig.py builds the sides)."""

from __future__ import annotations

from pd_connector.scheduling.layer_chunks import LayerChunk
from pd_connector.transfer.layerwise import LayerStreams, layer_regions_of
from tests.support.transfer_rig import LAYERS, Rig, Side


def layer_mode(rig: Rig, seed: int) -> tuple[Side, LayerStreams]:
    """A P side in layer mode and its LayerStreams."""
    p = rig.make("prefill", seed=seed, transfer_mode="layer")
    assert p.mgr.prefill is not None
    streams = p.mgr.prefill.enable_layer_push(layer_regions_of(p.kv, [1] * LAYERS))
    return p, streams


def run_step(streams: LayerStreams, chunks: list[LayerChunk], layers: int | None = None) -> None:
    """One forward pass: save_kv_layer for the first ``layers`` layers (all by default), then wait_for_save."""
    step = object()
    names = list(streams._layers)
    for name in names[: LAYERS if layers is None else layers]:
        streams.on_layer(chunks, step, name)
    if layers is None:
        streams.on_forward_end(chunks, step)


def chunk(room: int, src: list[int], start: int, end: int, final: bool) -> LayerChunk:
    """The chunk of request ``p-req`` (room ``room``) that computes tokens ``start``..``end`` of blocks ``src``."""
    return LayerChunk("p-req", room, tuple(src[:end]), start, end, final)
