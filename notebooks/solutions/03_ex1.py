import torch


def fixed_loss(logp, old, adv, mask):
    # buggy_loss minimises ratio * A, i.e. it *lowers* the probability of good answers.
    # Minimise -ratio * A instead (it also has no clipping and no KL term).
    ratio = torch.exp(logp - old)
    per_answer = -(ratio * adv[:, None] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_answer.mean()
