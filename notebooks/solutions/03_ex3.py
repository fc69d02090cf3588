import torch


def my_dual_clip_loss(ratio, adv, eps=0.2, c=3.0):
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    # only for A < 0: never let the objective fall below c * A (the loss never above c * |A|)
    surrogate = torch.where(adv < 0, torch.maximum(surrogate, c * adv), surrogate)
    return -surrogate
