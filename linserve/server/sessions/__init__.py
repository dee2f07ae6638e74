"""Sessions: the in-memory and Redis stores, the transcript rules for what a session
holds, and cached prompt tokens."""
