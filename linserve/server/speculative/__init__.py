"""Speculative decoding: draft tokens cheaply, verify them with the served model in one pass.

:mod:`.config` reads ``--speculative-config``; :mod:`.proposers` drafts (prompt-lookup n-grams, a
draft checkpoint); :mod:`.acceptance` sizes each request's drafts by what they have earned;
the engine's :mod:`linserve.server.engine.speculation` verifies and keeps the state exact.
"""
