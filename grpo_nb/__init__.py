"""grpo_nb — the helper library behind the grpo-notebooks course.

Data flows one way through the package::

    actors ──► toy ring (toy.py) ──────────────────────────► live plots (live.py)
      │                                                          ▲
      └────► LLM ring (llm.py): tasks → serving (vLLM) → grpo ───┘
                                   ▲            │
                                   └ weight_sync┘

Every module is importable on its own; heavy dependencies (vLLM, Monarch) are imported lazily
where they are used so that the toy half of the course runs without them.
"""

__version__ = "0.1.0"
