"""The ops backend the engine is written over, once: its protocol and three implementations.

``ops.py`` the protocol and the values crossing it (``QTensor``, ``ExpertLayout``); ``layouts.py``
where an expert's matrices sit in a slot; ``select.py`` ``runtime.backend`` → an implementation;
``numpy_ops.py`` the reference ops on host memory; ``dry_run.py`` charges without allocating
(``strata check``); ``cuda_ops.py`` the Numba kernels (``cuda``, and ``cudasim`` under the
simulator), with its KV and attention in ``cuda_attention_ops.py``, its routed experts in
``cuda_moe_ops.py`` and its output head in ``cuda_head_ops.py``; ``expert_arena.py`` the expert
cache's storage in VMM segments.
"""
