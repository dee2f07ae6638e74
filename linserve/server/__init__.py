"""The server side of linserve: settings, the HTTP API (``api/``), the engine process
(``engine/``), sessions and the prefix-state cache. ``serve.main`` starts it."""
