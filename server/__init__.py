"""linserve: an OpenAI-compatible server for models with constant-size recurrent state."""
