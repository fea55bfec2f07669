"""Integration tests: the proxy in front of real llama-servers built from the pinned sdist."""
