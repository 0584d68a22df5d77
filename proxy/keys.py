"""AppKeys of the proxy's aiohttp app (their own module so handlers and app avoid a cycle)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from engine_core.server.json_parser import JsonParser
from proxy.config import ProxyConfig
from proxy.dispatcher import Dispatcher
from proxy.legs import InflightLimiter
from proxy.metrics import ProxyMetrics
from proxy.model_cards import ModelCards
from proxy.placer import Placer
from proxy.registration import RegistrationServer
from proxy.registry import Clock, InstanceRegistry
from proxy.routing import RoutingPolicy

CONFIG = web.AppKey("config", ProxyConfig)
REGISTRY = web.AppKey("registry", InstanceRegistry)
POLICY = web.AppKey("policy", RoutingPolicy)
METRICS = web.AppKey("metrics", ProxyMetrics)
CLOCK = web.AppKey("clock", Clock)
ID_FACTORY = web.AppKey("id_factory", Callable[[], str])
LIMITER = web.AppKey("limiter", InflightLimiter)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
REGISTRATION_SERVER = web.AppKey("registration_server", RegistrationServer)
MODEL_CARDS = web.AppKey("model_cards", ModelCards)
PLACER = web.AppKey("placer", Placer)
JSON_PARSER = web.AppKey("json_parser", JsonParser)
