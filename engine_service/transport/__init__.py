"""The transport: the edge between the wire and the engine.

The gRPC server (server.py: EngineService, health, reflection, start-up, drain, fatal shutdown),
what it serves (engine_slot.py: LOADING while the model loads, then READY with the engine), its
servicer (servicer.py: bytes in, one frozen `Request` parsed at the boundary, protobuf deltas out,
every failure through the one status table of shared.errors), security (bearer tokens, TLS), and
what each request's end tells the operator (telemetry.py: the event, the span, the metrics;
metrics.py: the OpenTelemetry instruments and their Prometheus endpoint). Nothing here
imports torch. A new RPC goes in servicer.py; a new protocol (the HTTP front) is a sibling of
servicer.py that drives the same `Engine` with the same `Request.parse`.
"""
