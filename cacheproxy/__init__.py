"""cacheproxy: an exact, tenant-aware prompt-cache layer in front of llama-server."""

__version__ = "0.1.0"
