import torch


def my_k3(logp, ref_logp):
    log_rho = ref_logp - logp
    return torch.exp(log_rho) - 1 - log_rho
