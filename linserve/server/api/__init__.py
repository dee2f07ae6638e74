"""The HTTP side: the FastAPI app, its routes, the OpenAI request and response models,
SSE streaming, auth and errors; it talks to the engine through ``linserve.server.engine.client``."""
