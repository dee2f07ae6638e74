"""Anthropic's Messages API: requests, the conversion to and from chat, and the streamed
events."""
