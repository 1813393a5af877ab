"""How many bytes go where: placement under the budget, and the planner that picks each prefill's
geometry (chunk tokens, ring slots) with its cost model (``prefill_cost.py``)."""
