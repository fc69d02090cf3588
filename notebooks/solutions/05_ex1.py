import torch


def my_token_loss(logp, old, adv, mask, eps=0.2):
    ratio = torch.exp(logp - old)
    a = adv[:, None]  # one advantage per sample, broadcast over its tokens
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
    # one mean over every real completion token of the batch (not a mean per sample first)
    return -(surrogate * mask).sum() / mask.sum()
