"""Placing requests on slots: the token mirror, the slot table, the scheduler, the executor."""
