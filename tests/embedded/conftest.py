"""The embedded engine's tests import llama-cpp-python: install the pinned build (from the
cached wheel, built once) before their modules are collected. Only these tests need it, so a run
of the unit or integration tests never waits for the wheel."""

from __future__ import annotations

import importlib
import importlib.util

from cacheproxy.provision.build_engine import ensure_engine

if importlib.util.find_spec("llama_cpp") is None:
    ensure_engine()
    importlib.invalidate_caches()
