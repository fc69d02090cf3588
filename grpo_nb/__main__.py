"""``python -m grpo_nb COMMAND ...`` — the command line of the course.

Commands (each lives in the module that owns the work; imports are lazy so that ``doctor``
works even when vLLM or Monarch is missing)::

    doctor     what is installed, and what each notebook needs     grpo_nb.course.doctor
    toy        run the toy GRPO ring headless, write a PNG          grpo_nb.toy.run
    rollouts   tiny model + vLLM server + groups of completions     grpo_nb.serving.cli
    train      the asynchronous GRPO loop on the LLM                grpo_nb.llm.run
    handouts   student copies, executed HTML pages, one PDF         grpo_nb.course.handouts
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("grpo_nb.course.doctor", "check the environment (versions, CPU/GPU, memory, notebooks)"),
    "toy": ("grpo_nb.toy.run", "run the toy GRPO ring and write its plot"),
    "rollouts": ("grpo_nb.serving.cli", "serve the tiny model with vLLM and sample scored groups"),
    "train": ("grpo_nb.llm.cli", "asynchronous (or synchronous) GRPO on the LLM with weight sync"),
    "handouts": ("grpo_nb.course.handouts", "build workshop handouts (student copies, HTML, PDF)"),
}


def _usage() -> str:
    lines = ["usage: python -m grpo_nb COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n`python -m grpo_nb COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.cli(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
