"""HTTP APIs: the Parrot API (Semantic Variables) and an OpenAI-compatible API, on one FastAPI app."""

from parrot.api.app import create_app
from parrot.api.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
