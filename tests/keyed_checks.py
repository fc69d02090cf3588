"""What a server started with ``VLLM_API_KEY`` must do (used by the CLI's end-to-end test).

``/v1`` routes answer only keyed requests, the key is in neither argv nor the server's log, our
clients pass it, and the dev-mode routes (loopback only) are *not* guarded by it: that is why
a dev-mode server refuses any non-loopback host.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from grpo_nb.serving.client import ClientConfig, CompletionError, CompletionsClient
from grpo_nb.serving.server import VLLMServer


def status(url: str, data: dict | None = None, key: str | None = None) -> int:
    """The HTTP status of a GET (or a JSON POST when ``data`` is given)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if data is None:
        return httpx.get(url, headers=headers, timeout=30).status_code
    return httpx.post(url, json=data, headers=headers, timeout=30).status_code


def check_keyed_server(key: str, info: dict[str, Any], procs: list[Any]) -> None:
    """``info``: the server's ``url``, served ``model`` name and ``log`` path; ``procs``: its
    processes (psutil)."""
    assert not any(key in " ".join(p.cmdline()) for p in procs), "the key is in argv"
    assert key not in Path(info["log"]).read_text()
    url, body = info["url"], {"model": info["model"], "prompt": [3, 4], "max_tokens": 2}
    assert status(f"{url}/v1/completions", body) == 401
    assert status(f"{url}/v1/models") == 401
    assert status(f"{url}/v1/completions", body, key) == 200
    # Why a dev-mode server is loopback-only: its weight routes ignore the key.
    assert status(f"{url}/is_paused") == 200

    async def clients():
        cfg = ClientConfig(api_key=key)
        async with CompletionsClient(f"{url}/v1", info["model"], cfg) as keyed:
            out = (await keyed.generate([3, 4], max_tokens=3))[0]
        async with CompletionsClient(f"{url}/v1", info["model"], ClientConfig()) as unkeyed:
            with pytest.raises(CompletionError) as err:
                await unkeyed.generate([3, 4], max_tokens=3)
        return out, err.value

    out, err = asyncio.run(clients())
    assert len(out.token_ids) >= 1 and (err.kind, err.status) == ("http_4xx", 401)
    attached = VLLMServer.attach(url, api_key=key)
    assert attached.model_name == info["model"] and attached.api_key == key
