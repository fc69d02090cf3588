"""Trainer → running vLLM server weight sync through vLLM's weight-transfer flow (gloo on CPU,
reload from disk, NCCL / IPC on GPUs), every sync exactly verifiable."""

from grpo_nb.weight_sync.client import VLLMControlClient, WeightSyncError
from grpo_nb.weight_sync.config import EXTENSION, SyncResult, WeightSyncConfig, model_bytes
from grpo_nb.weight_sync.syncer import WeightSyncer

__all__ = ["EXTENSION", "SyncResult", "VLLMControlClient", "WeightSyncConfig", "WeightSyncError",
           "WeightSyncer", "model_bytes"]
