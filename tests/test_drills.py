"""Each reliability drill in its shortened (--quick) form: the same assertions as the full run.
The http drill runs against the real llama-server (`make peers`): where it is not built the test is
skipped, or failed under CI=true (tests/llama_server.py's require_llama_server)."""

from __future__ import annotations

import pytest

from drills import crash, drain, fuzz, http_peer, overload, readers, replicas
from drills.__main__ import DRILLS, run_one
from tests.llama_server import require_llama_server

# The replicas drill's quick form (about 28 s) is left to `make test-slow`: CI's compose drill
# (python -m drills --quick compose) runs the same audit of a rolling-restart sweep
# (drills.replicas.audit_rolling_sweep) over three replicas under a real Docker daemon. The crash
# drill's quick form (21-26 s) too: tests/test_bench_cli_drills.py runs its cases end to end one by
# one (an engine crash stops the sweep resumably, kill -9 of the client then resume gives every
# point once, a managed engine restarted after a crash), and the compose drill kills a replica
# under a sweep and audits that nothing was lost. The http drill's (about 30 s, kill -9 of a real
# llama-server and of the client) and the crash drill's (with its HTTP stream cut by the crash) run
# in CI after `make test` instead (.ci/run: python -m drills --quick ...), which keeps `make test`
# under 10 minutes on 2 cores. So do the four longest of the others (quick, Xeon of family 6 model
# 207: readers 17 s, drain 12, fuzz 10, overload 8), each of whose paths a test here also walks
# once: a stalled reader aborted and its KV freed (test_security.py), a drain that finishes in-flight
# streams and refuses new ones (test_engine_lifecycle.py), bad gRPC requests refused by name without
# disturbing a running stream (test_engine_contract.py; the HTTP front's by the fuzz-front drill
# below), a flood answered QUEUE_FULL with every accepted request completed (test_engine_scheduling.py).
SLOW = {replicas.NAME, crash.NAME, http_peer.NAME, readers.NAME, drain.NAME, fuzz.NAME, overload.NAME}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in DRILLS])
def test_drill_passes_quick(name: str) -> None:
    if name == http_peer.NAME:
        require_llama_server()
    row = run_one(name, quick=True)
    assert row.lost == 0, row
    assert row.passed, row.happened


def test_a_half_closed_callers_stream_may_be_cut_short_but_not_garbled() -> None:
    """fuzz-front's judgement of a half-closed caller's stream that ended early (the front read the
    FIN mid-stream, under load): whole events must still be the stream's own."""
    from drills.fuzz_front import cut_short_stream
    from drills.raw_http import Reply

    event = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    assert cut_short_stream(Reply(200, {}, event + b'data: {"cho', complete=False)) == []
    assert cut_short_stream(Reply(200, {}, b"", complete=False)) == []
    wrong = cut_short_stream(Reply(200, {}, event + b"data: {nope}\n\n" + event, complete=False))
    assert len(wrong) == 1 and "data: {nope}" in wrong[0][1]
    assert cut_short_stream(Reply(200, {}, b"event: ping\n\n", complete=False))
