"""``python -m grpo_nb COMMAND ...``: each command's module is imported only when it runs, so
``doctor`` works even when vLLM or Monarch is missing."""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {  # name: ("module[:function (default cli)]", help)
    "doctor": ("grpo_nb.course.doctor", "check the environment (versions, CPU/GPU, memory, notebooks)"),
    "toy": ("grpo_nb.toy.run", "run the toy GRPO ring and write its plot"),
    "rollouts": ("grpo_nb.llm.cli:rollouts", "serve the tiny model with vLLM and sample scored groups"),
    "train": ("grpo_nb.llm.cli", "asynchronous (or synchronous) GRPO on the LLM with weight sync"),
    "handouts": ("grpo_nb.course.handouts", "build workshop handouts (student copies, HTML, PDF)"),
}
USAGE = "\n".join(["usage: python -m grpo_nb COMMAND [options]", "", "commands:",
                   *(f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()),
                   "\n`python -m grpo_nb COMMAND --help` for a command's options."])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    module, _, function = COMMANDS[argv[0]][0].partition(":")
    return int(getattr(importlib.import_module(module), function or "cli")(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
