"""Typed application state: every shared object the handlers use, set up by the app factory."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from cacheproxy.cache_layer import CacheLayer
from cacheproxy.metrics import ProxyMetrics
from cacheproxy.settings import Settings
from cacheproxy.upstreams import UpstreamPool

SETTINGS = web.AppKey("settings", Settings)
SESSION = web.AppKey("upstream_session", aiohttp.ClientSession)
POOL = web.AppKey("upstream_pool", UpstreamPool)
METRICS = web.AppKey("metrics", ProxyMetrics)
CACHE = web.AppKey("cache_layer", CacheLayer)
