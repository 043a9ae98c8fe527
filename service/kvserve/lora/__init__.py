"""Multi-LoRA serving: PEFT adapters loaded, kept in slots, and applied per token.

- ``request.py``: ``LoRARequest`` (which adapter a request runs under);
- ``adapter.py``: reading and validating a PEFT adapter directory;
- ``slots.py``: which adapters sit in the compute device's slots (pins, LRU, draining);
- ``layers.py``: the batched LoRA math on the model's projections;
- ``manager.py``: the host-memory cache and the glue the engine holds.

See docs/engine.md, "LoRA adapters".
"""

from __future__ import annotations

from kvserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
