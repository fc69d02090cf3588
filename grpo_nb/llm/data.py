"""What the LLM ring is fed: arithmetic prompts (tokenized once), the held-out set, and the
:class:`RingSpec` bundle every actor receives besides the config::

    tasks.make_dataset ──► train rows ──encode──► [Prompt(text, ids, answer), ...]  (generators)
                      └──► test rows  ──encode──► (prompt_ids [N, P], answer_ids [N, A])  (eval)

All of it is plain data, so it pickles to actors on other processes (Monarch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class Prompt(NamedTuple):
    """One training problem: its text, its token ids (no special tokens) and the answer."""

    text: str
    ids: list[int]
    answer: str


@dataclass
class RingSpec:
    """Everything the actors need besides the config."""

    server_url: str
    model_name: str
    model_dir: str
    prompts: list[Prompt]
    eval_prompts: Any = None  # (prompt_ids [N, P], answer_ids [N, A]) tensors
    run_dir: str | None = None
    resume_dir: str | None = None


def load_prompts(tokenizer: Any, smoke: bool) -> tuple[list[Prompt], Any]:
    """Train prompts and the test set as fixed-length tensors (answers end with EOS)."""
    import torch

    from grpo_nb.tasks import ArithmeticTaskConfig, make_dataset

    ds = make_dataset(ArithmeticTaskConfig.smoke() if smoke else ArithmeticTaskConfig())

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    train = [Prompt(p, enc(p), a) for p, a in zip(ds["train"]["prompt"], ds["train"]["answer"],
                                                   strict=True)]
    test = ds["test"]
    prompts = torch.tensor([enc(p) for p in test["prompt"]])
    answers = torch.tensor([enc(a) + [tokenizer.eos_token_id] for a in test["answer"]])
    return train, (prompts, answers)
