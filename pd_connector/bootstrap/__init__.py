"""Control plane: the prefill deployment's bootstrap server and its HTTP client."""
