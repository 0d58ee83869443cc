"""AIPerf against our client on one real server: benchmarks/aiperf_crosscheck.py --short, once on
llama-server and once on this engine's OpenAI-compatible HTTP front (--server engine).

Left out of `make test` (marker `crosscheck`: a few minutes each, and AIPerf installed into its own
venv the first time); `pytest -m crosscheck` runs them. The llama-server one is skipped without
llama-server (`make peers`), failed instead under CI=true, as tests/llama_server.py's
require_llama_server does; the engine one needs only the packaged model (`make setup`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.engines import ROOT
from tests.llama_server import require_llama_server

SCRIPT = ROOT / "benchmarks" / "aiperf_crosscheck.py"
JUDGED = ("TTFT p50 ms", "TPOT p50 ms", "ITL mean ms", "output tok/s")


@pytest.mark.crosscheck
@pytest.mark.timeout(1500)  # first run: ~80 s to install AIPerf; then about 2-5 minutes
@pytest.mark.parametrize("server", ["llama-server", "engine"])
def test_aiperf_and_ours_agree_within_10_percent(tmp_path, server):
    if server == "llama-server":
        require_llama_server()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--short", "--server", server, "--out", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=1400, check=False)
    shown = f"--- stdout ---\n{proc.stdout}\n--- stderr tail ---\n{proc.stderr[-4000:]}"
    assert ("the engine's HTTP front" if server == "engine" else "llama-server (SmolLM2") in proc.stdout, shown
    for concurrency in (1, 8):
        assert f"c={concurrency}: " in proc.stdout, shown
    for row in JUDGED:
        # one row per concurrency, three where it disagreed (the second pair and both pairs' means)
        assert proc.stdout.count(f"  {row} ") == 2 + 2 * proc.stdout.count(" disagreed: a second pair"), shown
    assert proc.returncode == 0, shown
    assert "all judged figures agree within 10%" in proc.stdout, shown


# The engine's own view (fast: a written log, no server)

def _engine_log(tmp_path, lines):
    from benchmarks import aiperf_crosscheck as xc

    path = tmp_path / "engine.log"
    path.write_text("".join(lines))
    return xc, xc.EngineServer(core=0, ctx=2048, log_path=path)


def _finished(request_id, ended, duration_s, ttft_s, output_tokens=64, status="OK"):
    import json

    return json.dumps({"request_id": request_id, "status": status, "duration_s": duration_s, "prompt_tokens": 128,
                       "output_tokens": output_tokens, "ttft_s": ttft_s, "event": "request_finished",
                       "timestamp": f"2026-12-02T04:32:{ended:09.6f}Z"}) + "\n"


def test_the_engine_view_leaves_out_the_warmup_and_matches_each_statistic(tmp_path):
    xc, server = _engine_log(tmp_path, [
        '{"event": "engine_serving", "port": 1}\n', "a library's warning, not JSON\n",
        _finished("warmup", 10.0, 9.0, 5.0),  # would move every figure: left out
        _finished("a", 21.0, 1.26, 0.0),  # (1.26 - 0) / 63 = 20 ms a token
        _finished("b", 22.0, 2.0, 0.11),  # (2 - 0.11) / 63 = 30 ms
        _finished("c", 23.0, 4.0, 0.2),  # starts first: 19.0; (4 - 0.2) / 63
        _finished("d", 23.5, 0.5, 0.3, status="CANCELLED"),  # failed: left out
        '{"event": "request_finished", "status": "OK"',  # still being written: no newline yet
    ])
    view = server.own_timings(0, xc.Run(concurrency=2, requests=4, warmup=1, prompt_tokens=128, output_tokens=64))
    assert view["server's prompt tokens"] == 128
    assert view["server's TTFT ms p50"] == pytest.approx(110)
    assert view["server's ms/token p50"] == pytest.approx(30)
    assert view["server's ms/token mean"] == pytest.approx((20 + 30 + 3800 / 63) / 3)
    assert view["server's tok/s"] == pytest.approx(3 * 64 / (23.0 - 19.0))
    assert set(view) == set(server.shown) and set(server.view.values()) <= {(row, 1) for row in server.shown}


def test_the_engine_view_refuses_a_broken_event_naming_it(tmp_path):
    xc, server = _engine_log(tmp_path, [_finished("w", 1.0, 1.0, 0.1), '{"event": "request_finished", oops}\n'])
    run = xc.Run(concurrency=1, requests=1, warmup=1, prompt_tokens=128, output_tokens=64)
    with pytest.raises(xc.CrosscheckError, match="engine.log: a line after byte 0 is not JSON"):
        server.own_timings(0, run)
    xc, server = _engine_log(tmp_path, [_finished("w", 1.0, 1.0, 0.1), _finished("m", 2.0, 1.0, None)])
    with pytest.raises(xc.CrosscheckError, match=r"request 'm' \(status OK\) has ttft_s=None, not a number"):
        server.own_timings(0, run)


# llama-server's own view (fast: a written log, no server)

def _slot_lines(stamp_launch, stamp_end, task, prompt_ms, eval_ms, tokens=64):
    """One task's lines as llama-server logs them, stamped minutes.seconds.milliseconds.microseconds."""
    def stamp(t):
        us = round(t * 1e6)
        return f"{us // 60_000_000}.{us // 1_000_000 % 60:02d}.{us // 1000 % 1000:03d}.{us % 1000:03d}"

    head = f"slot print_timing: id  3 | task {task} |"
    return (f"{stamp(stamp_launch)} I slot launch_slot_: id  3 | task {task} | processing task, is_child = 0\n"
            f"{stamp(stamp_end)} I {head} prompt eval time = {prompt_ms:10.2f} ms /   128 tokens (    9.00 ms per "
            "token,   111.00 tokens per second)\n"
            f"{stamp(stamp_end)} I {head}        eval time = {eval_ms:10.2f} ms / {tokens:5d} tokens "
            f"({eval_ms / tokens:8.2f} ms per token,    60.00 tokens per second)\n"
            f"{stamp(stamp_end)} I {head}       total time = {prompt_ms + eval_ms:10.2f} ms /   192 tokens\n"
            f"{stamp(stamp_end)} I slot      release: id  3 | task {task} | stop processing: n_tokens = 191\n")


def test_the_llama_server_view_counts_ttft_from_the_launch_and_leaves_out_the_warmup(tmp_path):
    from benchmarks import aiperf_crosscheck as xc

    path = tmp_path / "llama-server.log"
    path.write_text("0.00.433.477 I srv  llama_server: listening on http://127.0.0.1:1\n"
                    + _slot_lines(1.0, 3.0, 0, 900.0, 1100.0)  # the warmup: would move every figure
                    + _slot_lines(59.5, 62.0, 5, 1000.0, 1280.0)  # TTFT 2,500 - 1,280 = 1,220 ms; 20 ms a token
                    + _slot_lines(59.6, 64.5, 6, 2000.0, 1920.0)  # waited behind task 5: TTFT 4,900 - 1,920
                    + _slot_lines(62.1, 63.9, 7, 600.0, 1600.0))  # 200 ms of wait, 25 ms a token
    server = xc.LlamaServer(core=0, ctx=2048, log_path=path)
    view = server.own_timings(0, xc.Run(concurrency=2, requests=3, warmup=1, prompt_tokens=128, output_tokens=64))
    assert view["server's prompt ms p50"] == pytest.approx(1000)
    assert view["server's TTFT ms p50"] == pytest.approx(1220)  # of 1,220, 2,980 and 200
    assert view["server's ms/token p50"] == pytest.approx(25)
    assert view["server's ms/token mean"] == pytest.approx((20 + 30 + 25) / 3)
    assert view["server's tok/s"] == pytest.approx(3 * 64 / (64.5 - 59.5))
    assert set(server.view.values()) <= {(row, 1) for row in server.shown} and set(view) < set(server.shown)
    path.write_text(_slot_lines(1.0, 3.0, 0, 900.0, 1100.0).split("\n", 1)[1])  # no launch line
    with pytest.raises(xc.CrosscheckError, match="task 0's eval time at 0.03.000.000 has no launch_slot_ line"):
        server.own_timings(0, xc.Run(concurrency=1, requests=1, warmup=0, prompt_tokens=128, output_tokens=64))


def test_a_clients_two_runs_pool_into_their_means():
    from benchmarks import aiperf_crosscheck as xc

    first = xc.Figures("ours", {"TTFT p50 ms": 100.0, "failed": 0.0, "retries": None}, note="usage",
                       others_busy_cores=0.02, wall_s=10.0)
    second = xc.Figures("ours", {"TTFT p50 ms": 300.0, "failed": 2.0, "retries": 1.0}, others_busy_cores=0.4, wall_s=5.0)
    both = xc.pooled(first, second)
    assert both.values == {"TTFT p50 ms": 200.0, "failed": 1.0, "retries": None}
    assert (both.client, both.others_busy_cores, both.wall_s) == ("ours", 0.4, 15.0)
    assert both.note == "usage; the mean of 2 runs"
