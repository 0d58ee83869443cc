"""The committed generated code is what `python tools/gen_proto.py` makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py"]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), "--out", str(tmp_path)], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "engine" / "v1" / name).read_text()
        committed = (ROOT / "engine" / "v1" / name).read_text()
        assert committed == fresh, f"engine/v1/{name} is stale: run `python tools/gen_proto.py` and commit"
