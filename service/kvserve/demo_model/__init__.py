"""The bundled demo model: a tiny travel-assistant Llama trained by the project.

``corpus`` generates its training conversations, ``tokenizer`` its byte-level BPE and
chat template, ``train`` the model (``kvserve train-demo``), ``evaluate`` its held-out
figures (``kvserve eval-demo``). The checkpoint ships in :data:`DEMO_MODEL_DIR`.
``train_adapter`` trains its demo LoRA adapter (``kvserve train-demo --adapter
travel-table``), whose answer layout is ``table_style``; it ships in ``adapters/``.
"""

from __future__ import annotations

from pathlib import Path

DEMO_MODEL_NAME = "kvserve-travel-tiny"
DEMO_MODEL_DIR = Path(__file__).resolve().parent / DEMO_MODEL_NAME
#: The adapters ``kvserve train-demo --adapter NAME`` can train, by name (here, not in
#: ``train_adapter``, so that a wrong name is refused before torch is imported).
ADAPTER_NAMES = ("travel-table",)
#: Where the trained adapters ship: ``ADAPTERS_DIR / NAME``.
ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"


def default_model_dir() -> Path:
    """The bundled checkpoint's directory (what ``LLM()`` and ``kvserve serve`` use)."""
    if not (DEMO_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the bundled demo model is missing from {DEMO_MODEL_DIR}; "
            "regenerate it with `kvserve train-demo` or pass a model directory"
        )
    return DEMO_MODEL_DIR


def bundled_model_calls_tools() -> bool:
    """Whether the bundled checkpoint was trained to call ``search_hotels`` (``kvserve
    train-demo``, not ``--no-tools``): its tokenizer then has the tool tokens and the tool
    template."""
    config = DEMO_MODEL_DIR / "tokenizer_config.json"
    return config.exists() and "<tool_call>" in config.read_text(encoding="utf-8")
