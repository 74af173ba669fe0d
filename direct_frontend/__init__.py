"""direct-frontend: an OpenAI-compatible router that talks gRPC straight to stock engines."""

__version__ = "0.1.0"
