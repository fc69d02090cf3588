"""Trainer → vLLM weight sync: vLLM's own weight-transfer flow, with a CPU engine of ours.

::

    trainer model ──WeightSyncer.sync(v)──► /pause ─► transport ─► version v ─► /resume
                                                       │                          │
                    gloo   (CPU): gloo_engine.py, registered into vLLM's factories;
                                  its group listens on 127.0.0.1 only (gloo_group.py)
                    reload (CPU): safetensors on disk + /collective_rpc grpo_reload_weights
                    nccl   (GPU): vLLM's NCCL engine, same interface
                                                                                  ▼
                 verify(): the digest of every tensor the server's load_weights received
                           == the trainer's, bit for bit (verify.py; over /collective_rpc)

The server must load :mod:`grpo_nb.weight_sync.worker` with ``--worker-extension-cls``
(:meth:`WeightSyncConfig.server_settings` returns the ``ServerConfig`` fields to set).
"""

from grpo_nb.weight_sync.client import VLLMControlClient, WeightSyncError, policy_salt
from grpo_nb.weight_sync.syncer import (
    EXTENSION,
    SyncResult,
    WeightSyncConfig,
    WeightSyncer,
    model_bytes,
)

__all__ = ["EXTENSION", "SyncResult", "VLLMControlClient", "WeightSyncConfig", "WeightSyncError",
           "WeightSyncer", "model_bytes", "policy_salt"]
