"""Adapters to the vLLM lines PDConnector runs on (vllm 0.32 and 0.23, vLLM-Ascend 0.23's engine)."""
