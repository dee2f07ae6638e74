"""Values read from a Hugging Face ``config.json`` the same way in every family: floats as
transformers writes them, and the rotary settings, which transformers 5 keeps under
``rope_parameters`` and older configs at the top level."""

from __future__ import annotations

from typing import Any


def json_float(value: Any) -> float:
    """A float from config.json, where transformers writes infinity as
    ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def rope_parameters(c: dict[str, Any]) -> dict[str, Any]:
    """config.json's ``rope_parameters`` ({} where it has none)."""
    return c.get("rope_parameters") or {}


def rope_theta(c: dict[str, Any], default: float) -> float:
    """The rotary base: ``rope_parameters.rope_theta``, else a top-level ``rope_theta``,
    else the family's ``default``."""
    return float(rope_parameters(c).get("rope_theta", c.get("rope_theta", default)))
