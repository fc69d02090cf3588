"""Checkpoints that survive a crash at any moment: each folder is written and fsynced, then the
``checkpoint`` link is switched to it by one atomic rename, and only then are older ones removed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

STATE = "trainer_state.json"  # written last: its presence marks a complete folder


def _fsync(*paths: Path) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)  # a file or a folder (its entries)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(folder: Path | str, model: Any, tokenizer: Any, optimizer: Any,
         state: dict[str, Any]) -> Path:
    """Write model (HF format), tokenizer, optimizer and ``state``; link ``folder`` to it."""
    link = Path(folder)
    link.parent.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{int(state.get('step', 0)):06d}-{uuid.uuid4().hex[:6]}"
    tmp = link.parent / f"{name}.tmp"
    tmp.mkdir()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / STATE).write_text(json.dumps(state, indent=1))
    _fsync(*(p for p in tmp.rglob("*") if p.is_file()), tmp)
    final = link.parent / name
    tmp.rename(final)
    staged = link.parent / f"{link.name}.tmp-link"
    with contextlib.suppress(FileNotFoundError):
        staged.unlink()
    staged.symlink_to(name)  # relative: the run folder can be moved
    os.replace(staged, link)  # the atomic switch
    _fsync(link.parent)
    for old in link.parent.glob("ckpt-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return link


def resolve(folder: Path | str) -> Path:
    """The complete checkpoint folder that ``folder`` names (or the newest one beside it)."""
    folder = Path(folder)
    if (folder / STATE).is_file():
        return folder
    done = sorted((p for p in folder.parent.glob("ckpt-*")
                   if not p.name.endswith(".tmp") and (p / STATE).is_file()),
                  key=lambda p: json.loads((p / STATE).read_text()).get("step", 0))
    if not done:
        raise FileNotFoundError(f"no complete checkpoint at {folder}")
    return done[-1]


def load(folder: Path | str, model: Any, optimizer: Any) -> dict[str, Any]:
    """Restore a :func:`save` folder into ``model`` and ``optimizer``; its saved state."""
    from safetensors.torch import load_file

    folder = resolve(folder)
    weights = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ValueError(f"checkpoint {folder} does not fit the model: missing={missing} "
                         f"unexpected={unexpected}")
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    return json.loads((folder / STATE).read_text())
