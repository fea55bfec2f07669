"""Helpers shared by the tests: real servers, SSE parsing, slot-file fixtures."""
