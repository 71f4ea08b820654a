"""Hosts as configured (server.host, router.host): a name, an IPv4 address, or an IPv6 one with or without
brackets (`::1`, `[::1]`). gRPC takes host:port with an IPv6 address in brackets; sockets take it bare."""

from __future__ import annotations

import ipaddress


def bare_host(host: str) -> str:
    """The host for a socket: an IPv6 address without its brackets."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """host:port as gRPC takes it (and as logs show it): [::1]:50051."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    host = bare_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
