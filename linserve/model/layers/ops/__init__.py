"""Attention forms. Each causal linear form shares one signature returning ``(out, s, z)``."""
