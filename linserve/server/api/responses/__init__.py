"""The OpenAI Responses API: requests, output items, streamed events and stored responses
(a stored response is a session whose state is the conversation after its reply)."""
