"""Trainer → running vLLM server weight sync through vLLM's weight-transfer flow (gloo on CPU,
reload from disk, NCCL / IPC on GPUs), every sync exactly verifiable. The control-plane client
is ``grpo_nb.serving.control``'s (re-exported here); the server's side is ``server_side.py``."""

from grpo_nb.serving.control import VLLMControlClient, WeightSyncError
from grpo_nb.weight_sync.config import EXTENSION, SyncResult, WeightSyncConfig, model_bytes
from grpo_nb.weight_sync.syncer import State, WeightSyncer

__all__ = ["EXTENSION", "State", "SyncResult", "VLLMControlClient", "WeightSyncConfig",
           "WeightSyncError", "WeightSyncer", "model_bytes"]
