"""End-to-end tests: real `vllm serve` processes, marked `pytest.mark.e2e`."""
