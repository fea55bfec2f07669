"""Unit tests: pure policies, parsers and stores; no llama-server, no engine."""
