"""vLLM-Ascend specifics: its settings and environment, its platform, its P/D size keys and its layer-wise (D-first) proxy's metaserver."""
