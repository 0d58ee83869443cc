"""The benchmark sweep client of the engine.v1 service: sweeps, durable results, report."""
