"""Code shared by the engine service and the bench client: errors, logging, tracing, config."""
