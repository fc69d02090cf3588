"""Loopback helpers: every socket grpo_nb binds (servers, rendezvous stores) is local-only.

A port bound to ``0.0.0.0`` is reachable from the whole network; vLLM's weight routes and the
gloo store trust whoever connects, so nothing of ours listens anywhere but loopback.

Synchronous HTTP to a server goes through :func:`http` (``httpx``); the rollouts' async client
is ``httpx.AsyncClient`` too (:mod:`grpo_nb.serving.client`).
"""

from __future__ import annotations

import ipaddress
import socket
import threading

import httpx

LOOPBACK = "127.0.0.1"
_LOCAL = threading.local()


def http() -> httpx.Client:
    """This thread's ``httpx.Client``: connections kept alive, one pool per thread (a sync
    calls from two)."""
    if getattr(_LOCAL, "client", None) is None:
        _LOCAL.client = httpx.Client()
    return _LOCAL.client


def is_loopback(host: str) -> bool:
    """``True`` for ``localhost``, ``127.x.y.z`` and ``::1``; hostnames other than
    ``localhost`` are not resolved (they could point anywhere), so they count as remote."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = LOOPBACK) -> int:
    """A loopback port the OS reports free right now (another process could still take it)."""
    if not is_loopback(host):
        raise ValueError(f"free_port(host={host!r}): only loopback addresses are bound here")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((LOOPBACK if host == "localhost" else host, 0))
        return s.getsockname()[1]
