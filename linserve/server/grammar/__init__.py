"""Structured outputs: grammars from request fields, their compiled cache, and token masks."""
