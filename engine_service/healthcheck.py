"""`python -m engine_service.healthcheck ADDRESS`: exit 0 iff the engine's grpc.health.v1 says SERVING.

For container health checks (docker compose, Kubernetes exec probes). Imports neither torch nor
the engine. Exit 1 when the engine answers anything else or does not answer within --timeout.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(True, "SERVING") when healthy, else (False, what was seen)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return False, f"{err.code().name}: {err.details()}"
    return reply.status == SERVING, health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_service.healthcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("address", help="HOST:PORT of the engine, e.g. 127.0.0.1:50051")
    parser.add_argument("--service", default="", help="health service name ('' is the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    healthy, seen = check(args.address, args.service, args.timeout)
    print(f"{args.address}: {seen}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
