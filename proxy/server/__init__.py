"""The Router's HTTP server: the raw HTTP/1.1 listener, its limits, its processes and log lines."""
