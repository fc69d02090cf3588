"""A gloo process group that listens on loopback only.

torch's ``TCPStore(is_master=True)`` and gloo's default device both bind every interface: anyone
on the network could join the rendezvous or connect to a pair socket, and the worker loads
whatever arrives as model weights. Here every listening socket is bound to ``127.0.0.1``::

    rank 0 (trainer)                                   rank 1 (vLLM worker)
    listen_loopback() ─► socket bound 127.0.0.1:port
    open_group(listen_socket=…)  TCPStore master ◄──── open_group(port=…)  TCPStore client
        gloo device bound 127.0.0.1 ◄════ pair connection ════► gloo device bound 127.0.0.1

The group leaves ``torch.distributed``'s global state alone (like vLLM's stateless groups), so
it coexists with any group the trainer or vLLM already runs.
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from typing import Any

import torch

from grpo_nb.serving.net import LOOPBACK, is_loopback

PREFIX = "grpo_nb/weight_sync"


def listen_loopback() -> socket.socket:
    """A listening socket on ``127.0.0.1`` and a free port, for rank 0's store.

    Binding it ourselves (rather than picking a free port and letting the store bind it)
    both pins the address and removes the race where another process takes the port.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(8)
    except OSError:
        sock.close()
        raise
    return sock


def open_group(rank: int, world_size: int, timeout_s: float, *, port: int | None = None,
               listen_socket: socket.socket | None = None, host: str = LOOPBACK) -> Any:
    """Join a gloo group of ``world_size`` ranks; blocks until all ranks joined (or timeout).

    Rank 0 passes ``listen_socket`` (from :func:`listen_loopback`) and hosts the store on it;
    the other ranks pass the store's ``port``.
    """
    from torch._C._distributed_c10d import ProcessGroup
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    if not is_loopback(host):
        raise ValueError(f"open_group(host={host!r}): the weight-transfer group is loopback-only")
    timeout = timedelta(seconds=timeout_s)
    if listen_socket is not None:
        port = listen_socket.getsockname()[1]
        fd = listen_socket.detach()  # the store owns the socket from here on
        try:
            store = TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                             master_listen_fd=fd)
        except Exception:
            socket.close(fd)
            raise
    elif port is not None:
        store = TCPStore(host, port, world_size, False, timeout)
    else:
        raise ValueError("open_group: pass listen_socket (rank 0) or port (other ranks)")
    prefixed = PrefixStore(PREFIX, store)
    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    group = ProcessGroup(prefixed, rank, world_size)
    backend = ProcessGroupGloo(prefixed, rank, world_size, options)
    backend._set_sequence_number_for_group()
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group


def close_group(group: Any, *, abort: bool = False) -> None:
    """Tear the group down; ``abort`` closes its sockets at once, so a peer blocked in a
    receive fails now ("connection closed by peer") instead of at the gloo timeout. An abort
    never raises: it may re-raise the error of an operation still pending (a receive that
    timed out), which is why the group is being dropped and was reported where it happened."""
    if abort:
        with contextlib.suppress(Exception):
            group.abort()
    else:
        group.shutdown()
