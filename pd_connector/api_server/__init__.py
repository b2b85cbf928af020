"""What PDConnector adds to ``vllm serve``'s API server: request validation and other routers' PD requests."""
