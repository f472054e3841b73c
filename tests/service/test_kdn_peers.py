"""The connection layer's per-address limits (kvcodec.service.server) against addresses this machine cannot
open connections from: IPv6 hosts, each holding a /64. Driven with stand-in transports, no sockets."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvcodec.service.server import PeerTable, handler_class, peer_key


class _Transport(asyncio.Transport):
    """A connection from ``peer``: records what is written and whether it was closed."""

    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer, self.out, self.closed = peer, b"", False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return (self.peer, 40000, 0, 0) if name == "peername" else default

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.out += bytes(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_an_ipv6_host_is_its_64_for_the_per_address_limits():
    """--peer-connections and the refusal throttles counted each IPv6 address: a host rotating addresses inside
    its /64 (privacy addresses do so by themselves) got a fresh cap with each. Now a /64 is one client; another
    /64, and an IPv4 address (mapped or not), are others."""
    assert peer_key("2001:db8:1:2::1") == peer_key("2001:db8:1:2:ffff:ffff:ffff:ffff") == "2001:db8:1:2::/64"
    assert peer_key("2001:db8:1:3::1") != peer_key("2001:db8:1:2::1")
    assert peer_key("::ffff:192.0.2.7") == peer_key("192.0.2.7") == "192.0.2.7"
    assert peer_key("fe80::1%eth0") == "fe80::/64" and peer_key(None) == "?" and peer_key("not-an-ip") == "not-an-ip"

    async def run() -> list[_Transport]:
        peers = PeerTable(2)
        server = web.Server(lambda request: web.Response())  # type: ignore[arg-type,return-value]
        cls = handler_class(peers)
        conns = []
        for addr in ("2001:db8:1:2::1", "2001:db8:1:2::2", "2001:db8:1:2::3", "2001:db8:1:3::1"):
            t = _Transport(addr)
            cls(server, loop=asyncio.get_running_loop()).connection_made(t)
            conns.append(t)
        return conns

    conns = asyncio.run(run())
    refused = [t.out.startswith(b"HTTP/1.1 429") and t.closed for t in conns]
    assert refused == [False, False, True, False], [t.out[:40] for t in conns]
