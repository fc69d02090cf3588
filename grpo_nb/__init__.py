"""grpo_nb — the helper library behind the grpo-notebooks course.

One ring, two scales. Data flows one way through the package::

    actors/ ──► ring.py (Stage, Source/Relay/Sink, Controller) ──┬──► toy/  (MLP policy, bandit)
                                                                 └──► llm/  (Qwen model via vLLM)
    grpo.py (the objective) ──► toy/, llm/                                 │    │
    tasks/, tiny_model.py ──► serving/ (vLLM server, client, rollouts) ◄───┘    │
                              weight_sync/ (trainer → running server) ◄─────────┘
    metrics.py ──► live.py (toy plots) ──► llm/dashboard.py
    course/ (doctor, handouts) and __main__.py (the CLI) sit on top.

Every module is importable on its own; heavy dependencies (vLLM, Monarch) are imported lazily
where they are used so that the toy half of the course runs without them. The architecture,
with a table of which notebook uses which module, is in ``docs/architecture.md``.
"""

__version__ = "0.1.0"
