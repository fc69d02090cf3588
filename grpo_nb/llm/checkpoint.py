"""Checkpoints that survive a crash at any moment: each is written to a folder of its own,
fsynced, then ``runs/<name>/checkpoint`` (a symbolic link) is switched to it with one atomic
rename; older folders are removed only after that. :func:`resolve` also finds the newest
complete folder when the link is missing (a copy that did not keep links).
"""

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


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
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
    _fsync_tree(tmp)
    final = link.parent / name
    tmp.rename(final)
    staged = link.parent / f"{link.name}.tmp-link"
    with contextlib.suppress(FileNotFoundError):
        staged.unlink()
    staged.symlink_to(name)  # relative: the run folder can be moved
    os.replace(staged, link)  # the atomic switch
    _fsync_dir(link.parent)
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
