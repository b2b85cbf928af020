"""Parallel and memory layouts: KV regions, TP and PP mapping between P and D, KV cache groups."""
