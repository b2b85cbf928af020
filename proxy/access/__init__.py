"""Who may call the Router and how: API keys, the admin token, TLS."""
