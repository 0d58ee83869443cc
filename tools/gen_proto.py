"""Regenerate the Python code for proto/ (messages, .pyi stubs and gRPC stubs).

    python tools/gen_proto.py            # writes engine/v1/engine_pb2{,_grpc}.py{,i}
    python tools/gen_proto.py --out DIR  # writes under DIR instead (the freshness test uses this)
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = ["engine/v1/engine.proto"]


def generate(out: Path) -> None:
    """Run protoc for every file in PROTO_FILES with `out` as the output root."""
    out.mkdir(parents=True, exist_ok=True)
    include = str(resources.files("grpc_tools") / "_proto")
    for name in PROTO_FILES:
        args = [
            "protoc",
            f"-I{ROOT / 'proto'}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            name,
        ]
        if protoc.main(args) != 0:
            sys.exit(f"protoc failed for {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
