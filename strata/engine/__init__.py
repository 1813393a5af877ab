"""The engine: load a model under a VRAM budget, then serve one request at a time.

``facade.py`` ``Engine`` (load, warm-up, generate: what serve, bench and the CLI call);
``core.py`` its declared parts; ``generation.py`` one request's path (prefix reuse → loan →
prefill → decode); ``runner.py`` the model's forward over the ops; ``sampling.py``;
``request.py``, ``stream_stats.py`` and ``counters.py`` what a request reports. Rooms:
``memory/`` (expert cache and pack, staging ring, prompt workspace, decode-only resources),
``planning/`` (placement, the planner and its prefill cost model), ``loan/`` (the loan
transaction, admission, runtime state), ``decode/`` (captured decode steps).
"""
