"""The HTTP front end: OpenAI-compatible routes, the web chat page and /metrics."""
