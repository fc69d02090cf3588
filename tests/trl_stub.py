"""TRL 1.16's own ``GRPOTrainer._compute_loss`` run on given tensors, through a stub trainer
that holds only what that method reads (one process, no model): the reference the loss tests
compare ``grpo_nb.grpo.policy_loss`` with."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch


def trl_loss(logp: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
             adv: torch.Tensor, *, loss_type: str, eps_low: float, eps_high: float,
             beta: float, level: str = "token", opm: float | None = None,
             delta: float | None = None, sapo: tuple[float, float] = (1.0, 1.05),
             sampler: torch.Tensor | None = None, is_ratio: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """TRL's loss of ``logp`` (and the metrics it logs under ``eval``): ``level`` is TRL's
    ``importance_sampling_level``, ``opm`` its ``off_policy_mask_threshold``, ``sapo`` its
    SAPO temperatures (positive, negative); ``is_ratio`` set turns on vLLM's importance
    sampling correction (``sampler``: the sampler's log-probs, for the off-policy mask)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    b, t = logp.shape
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=opm,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1,
                             sapo_temperature_pos=sapo[0], sapo_temperature_neg=sapo[1]),
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        max_completion_length=t,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=False),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(
            reduce=lambda x, reduction: x,
            gather=lambda x: x,
            gather_for_metrics=lambda x: x,
            num_processes=1,
        ),
    )
    inputs: dict[str, Any] = {
        "prompt_ids": torch.zeros(b, 1, dtype=torch.long),
        "prompt_mask": torch.ones(b, 1),
        "completion_ids": torch.zeros(b, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),  # dapo / cispo: the accumulated batch's tokens
    }
    if sampler is not None:
        inputs["sampling_per_token_logps"] = sampler
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(stub, None, inputs), stub._metrics["eval"]
