"""A stand-in for Jaeger where its image cannot be pulled (deploy/compose.offline.yml runs it from the
project's own image): an OTLP/gRPC trace receiver that keeps no spans, only counts them, and logs a
line with the running totals by service.name after each export, e.g.
    {"event": "otlp_spans", "received": 12, "totals": {"engine": 40, "bench-client": 9}}

    python /sink/otlp_sink.py [--port 4317]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import Counter
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class CountingTraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self.lock = threading.Lock()

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        received: Counter[str] = Counter()
        for rs in request.resource_spans:
            service = next((kv.value.string_value for kv in rs.resource.attributes if kv.key == "service.name"), "")
            received[service] += sum(len(ss.spans) for ss in rs.scope_spans)
        with self.lock:  # one whole line per export, in the order of the totals: exports come on 4 threads,
            # and print's two writes (text, then newline) of two at once interleaved into one line of two
            # objects, which the compose drill could not parse (a clean-clone CI run, 2026-12-02)
            self.totals.update(received)
            line = {"event": "otlp_spans", "received": sum(received.values()), "totals": dict(self.totals)}
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(CountingTraceService(), server)
    server.add_insecure_port(f"0.0.0.0:{args.port}")
    server.start()
    print(json.dumps({"event": "otlp_sink_listening", "port": args.port}), flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
