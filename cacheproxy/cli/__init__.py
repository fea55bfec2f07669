"""The `cacheproxy` command."""
