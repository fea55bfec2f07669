"""First-party plugins, registered through the same entry points as third-party ones."""
