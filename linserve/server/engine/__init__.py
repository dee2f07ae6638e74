"""The engine: the continuous-batching scheduler, its process and the client the HTTP side
uses to reach it, running sequences, the slot pool and session replays."""
