"""The Router's backends: the HTTP client, one-shot calls and failure classes, the pool and routing."""
