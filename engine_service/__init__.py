"""The LLM decode engine served over gRPC (engine.v1)."""

__version__ = "0.1.0"
