"""The OpenAI HTTP API of one engine replica (FastAPI), the same app standalone and in Ray Serve."""
