"""The request-scoped prefill VRAM loan: the transaction around every prefill, the startup admission
rules, the resource protocols, and the runtime state put back before decode."""
