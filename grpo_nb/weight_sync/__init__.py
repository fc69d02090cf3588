"""Trainer → running vLLM server weight sync: vLLM's own weight-transfer flow, with a CPU
engine of ours (gloo), reload from disk, and vLLM's NCCL / IPC engines on GPUs; every sync
exactly verifiable. The server loads :mod:`grpo_nb.weight_sync.worker` with
``--worker-extension-cls`` (:meth:`WeightSyncConfig.server_settings`)."""

from grpo_nb.weight_sync.client import VLLMControlClient, WeightSyncError
from grpo_nb.weight_sync.config import EXTENSION, SyncResult, WeightSyncConfig, model_bytes
from grpo_nb.weight_sync.syncer import WeightSyncer

__all__ = ["EXTENSION", "SyncResult", "VLLMControlClient", "WeightSyncConfig", "WeightSyncError",
           "WeightSyncer", "model_bytes"]
