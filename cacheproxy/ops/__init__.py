"""Running it: metrics, logs, systemd notification."""
