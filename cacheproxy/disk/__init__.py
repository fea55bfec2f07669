"""The disk tier: what to archive and restore (pure), the store (files and index), slot files."""
