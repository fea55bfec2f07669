"""The llama-servers behind the proxy: the pool, the client for its own calls, a managed child."""
