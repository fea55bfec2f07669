"""Tenants: the registry, who a request acts for, the admin API and dashboard."""
