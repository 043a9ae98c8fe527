"""The rule for the names clients send as a request's ``"model"``: served model names
and LoRA adapter names, wherever they are set (``kvserve serve``, the gateway's config
and its Kubernetes discovery, the operator's ``spec.model.servedName``).

A name is also what logs, spans and metric labels carry and what a keys file lists, so
it is one printable word, and not the keys file's ``*`` (every model).
"""

from __future__ import annotations

WILDCARD = "*"  # in a keys file's ``models``: every model


def model_name_problem(name: str, what: str = "model name") -> str | None:
    """Why ``name`` cannot name a model (``what`` says which kind of name), or None."""
    if not name:
        return f"{what} must not be empty"
    if not name.isprintable() or any(c.isspace() for c in name):
        return f"{what} {name!r} may not contain whitespace or control characters"
    if name == WILDCARD:
        return f"{what} '*' is reserved: a keys file's '*' means every model"
    return None
