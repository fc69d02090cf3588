"""Loopback and HTTP helpers: nothing of ours listens anywhere but loopback (vLLM's weight
routes and the gloo store trust whoever connects), and every HTTP call goes through ``httpx``
with ``trust_env=False``: a proxy from ``HTTP_PROXY`` & co. never sees a loopback request."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the first call: configs and the GPU probe need no httpx
    import httpx

LOOPBACK = "127.0.0.1"
_LOCAL = threading.local()


def http() -> httpx.Client:
    """This thread's ``httpx.Client`` (connections kept alive). A sync calls from two threads: one
    client each, so a connection a failed call on one thread left closed is not reused by the other."""
    import httpx

    if getattr(_LOCAL, "client", None) is None:
        _LOCAL.client = httpx.Client(trust_env=False)
    return _LOCAL.client


def env_api_key() -> str | None:
    return os.environ.get("VLLM_API_KEY") or None


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def is_loopback(host: str) -> bool:
    """``localhost``, ``127.x.y.z`` or ``::1`` (other names are not resolved: remote)."""
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
