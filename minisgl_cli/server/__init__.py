"""HTTP front: FastAPI app, OpenAI-compatible routes, launch."""
