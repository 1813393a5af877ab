"""Decode token by token: the captured per-layer segments (CUDA graphs) and the greedy tail that
picks the next token on the device, over ``DecodeLayers`` (``layers.py``), what decode needs of
the model, which the runner implements."""
