"""The knowledge delivery network service (``kvc serve``): a shared, authenticated HTTP front of a store.

Server side only (needs aiohttp and prometheus-client: ``pip install 'kvcodec[kdn]'``).
Clients reach it through the store URL ``kvc+http://host:port`` (:mod:`kvcodec.store.tiers.kdn`).
"""

from kvcodec.service.auth import Principal, TokenTable
from kvcodec.service.app import KdnService, make_app, serve
from kvcodec.service.config import ServiceConfig

__all__ = ["Principal", "TokenTable", "KdnService", "ServiceConfig", "make_app", "serve"]
