"""The engine.v1 contract cannot break silently: buf lints proto/ and fails every breaking edit.

Each test copies proto/ and buf.yaml to a temporary directory, applies one edit, and runs
`buf breaking` against the released contract (contract/engine-v1.released.json), as .ci/run does.
buf is the one pinned in tools/buf/ (`npm ci --prefix tools/buf --ignore-scripts`, which .ci/run
runs); where it is not installed these tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUF = ROOT / "tools" / "buf" / "node_modules" / ".bin" / "buf"
RELEASED = ROOT / "contract" / "engine-v1.released.json"
PROTO = Path("proto") / "engine" / "v1" / "engine.proto"


@pytest.fixture(scope="module")
def buf() -> Path:
    if not BUF.exists():
        pytest.skip("buf is not installed: run `npm ci --prefix tools/buf --ignore-scripts` (.ci/run does)")
    return BUF


def run_buf(buf: Path, cwd: Path, *args: str) -> tuple[int, list[dict]]:
    """Run buf in `cwd`; return its exit status and its findings (JSON lines on stdout)."""
    env = {**os.environ, "BUF_CACHE_DIR": str(cwd / ".buf-cache")}
    proc = subprocess.run([str(buf), *args, "--error-format", "json"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    findings = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    if proc.returncode not in (0, 100):  # 100: findings; anything else: buf itself failed
        pytest.fail(f"buf {' '.join(args)} failed to run (exit {proc.returncode}): {proc.stderr}")
    return proc.returncode, findings


def copy_contract(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    return tmp_path


def edit(workspace: Path, old: str, new: str) -> None:
    """Replace `old` (which must occur exactly once, so a stale edit cannot pass vacuously) by `new`."""
    path = workspace / PROTO
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {PROTO}: update this test"
    path.write_text(text.replace(old, new))


def breaking(buf: Path, workspace: Path) -> tuple[int, list[dict]]:
    return run_buf(buf, workspace, "breaking", "--against", str(RELEASED))


# Each edit breaks engine.v1 for clients already built against the released contract, with the
# buf rule that must name it. The first four break the wire; the rename keeps the bytes but breaks
# code that other teams generate from proto/ (why buf.yaml uses FILE rather than WIRE).
BREAKING_EDITS = {
    "renumbered field": ("uint32 max_new_tokens = 4;", "uint32 max_new_tokens = 99;", "FIELD_NO_DELETE"),
    "changed field type": ("uint32 max_new_tokens = 4;", "string max_new_tokens = 4;", "FIELD_SAME_TYPE"),
    "removed RPC": ("  rpc GetLoad(GetLoadRequest) returns (Load);\n", "", "RPC_NO_DELETE"),
    "removed enum value": ("  ERROR_REASON_QUEUE_FULL = 3;\n", "", "ENUM_VALUE_NO_DELETE"),
    "renamed field": ("bool ignore_eos = 7;", "bool keep_decoding_past_eos = 7;", "FIELD_SAME_NAME"),
}


@pytest.mark.parametrize("kind", sorted(BREAKING_EDITS))
def test_a_breaking_edit_fails_buf_breaking(buf: Path, tmp_path: Path, kind: str) -> None:
    old, new, rule = BREAKING_EDITS[kind]
    workspace = copy_contract(tmp_path)
    edit(workspace, old, new)
    status, findings = breaking(buf, workspace)
    assert status == 100, f"buf breaking accepted a {kind}"
    assert rule in {f["type"] for f in findings}, findings


def test_the_unmodified_contract_passes_buf_breaking(buf: Path, tmp_path: Path) -> None:
    assert breaking(buf, copy_contract(tmp_path)) == (0, [])


def test_a_new_optional_field_with_a_new_number_passes(buf: Path, tmp_path: Path) -> None:
    workspace = copy_contract(tmp_path)
    edit(workspace, "  bool ignore_eos = 7;\n",
         "  bool ignore_eos = 7;\n  // A compatible addition.\n  optional string note = 99;\n")
    assert breaking(buf, workspace) == (0, [])
    assert run_buf(buf, workspace, "lint") == (0, [])


def test_buf_lint_passes_on_proto(buf: Path) -> None:
    assert run_buf(buf, ROOT, "lint") == (0, [])


def test_lint_exceptions_are_exactly_the_two_released_response_names(buf: Path, tmp_path: Path) -> None:
    """buf.yaml's exceptions are comments on GetServerInfo and GetLoad alone: a new RPC is linted."""
    text = (ROOT / PROTO).read_text()
    ignored = re.findall(r"//\s*buf:lint:ignore (\S+)[^\n]*\n\s*rpc (\w+)\(", text)
    assert ignored == [("RPC_RESPONSE_STANDARD_NAME", "GetServerInfo"), ("RPC_RESPONSE_STANDARD_NAME", "GetLoad")]
    assert text.count("buf:lint:ignore") == 2
    workspace = copy_contract(tmp_path)
    edit(workspace, "  rpc GetLoad(GetLoadRequest) returns (Load);\n",
         "  rpc GetLoad(GetLoadRequest) returns (Load);\n  rpc Ping(PingRequest) returns (Pong);\n")
    (workspace / PROTO).write_text((workspace / PROTO).read_text() + "\nmessage PingRequest {}\n\nmessage Pong {}\n")
    status, findings = run_buf(buf, workspace, "lint")
    assert status == 100
    assert [f["type"] for f in findings] == ["RPC_RESPONSE_STANDARD_NAME"], findings
