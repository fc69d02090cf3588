"""grpo_nb: the helper library behind the grpo-notebooks course (one GRPO ring, two scales).

Heavy dependencies (vLLM, Monarch) are imported where they are used, so the toy half of the
course runs without them. ``docs/architecture.md`` maps the package and which notebook uses
which module.
"""

__version__ = "0.1.0"
