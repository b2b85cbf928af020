"""The ways a request is served besides two-instance attempts: first token, recompute, resume, KV move."""
