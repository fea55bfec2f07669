"""Plugins are found by name through entry points, one group per kind; built-ins register alike.

A plugin is a class with a nested pydantic `Options` model; it is built as `Plugin(options, deps)`,
where `deps` is whatever that kind's interface documents (often nothing). Config names one
implementation per kind; an unknown name fails at start-up with the names that are known.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from cacheproxy.errors import describe_validation_error

PluginKind = Literal["routing", "prompt_cache", "eviction"]

ENTRY_POINT_GROUPS: dict[PluginKind, str] = {
    "routing": "cacheproxy.routing",
    "prompt_cache": "cacheproxy.prompt_cache",
    "eviction": "cacheproxy.eviction",
}


class PluginError(ValueError):
    """A plugin that cannot be found, loaded or configured."""


def available(kind: PluginKind) -> dict[str, EntryPoint]:
    return {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUPS[kind])}


def load_plugin(
    kind: PluginKind, name: str, options: dict[str, Any] | None = None, deps: Any = None
) -> Any:
    """Find the `kind` plugin called `name`, validate its options and build it."""
    plugin_class, validated = _found(kind, name, options)
    return plugin_class(validated, deps)


def check_plugin(kind: PluginKind, name: str, options: dict[str, Any] | None = None) -> None:
    """Raise `PluginError` unless `name` is a known `kind` plugin that takes `options` (it is
    not built: that may need what only a running service has)."""
    _found(kind, name, options)


def _found(kind: PluginKind, name: str, options: dict[str, Any] | None) -> tuple[Any, BaseModel]:
    known = available(kind)
    if name not in known:
        names = ", ".join(sorted(known)) or "none installed"
        raise PluginError(f"unknown {kind} plugin {name!r}; known: {names}")
    plugin_class = known[name].load()
    options_model: type[BaseModel] = getattr(plugin_class, "Options", BaseModel)
    try:
        return plugin_class, options_model.model_validate(options or {})
    except ValidationError as exc:
        subject = f"bad options for {kind} plugin {name!r}"
        raise PluginError(describe_validation_error(exc, subject, show_input=True)) from exc
