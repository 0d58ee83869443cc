"""token_logprobs (logprobs.py) in-process: each chosen token's log_softmax value and the top
alternatives, most likely first, against values worked out here; token ids of any integer type;
and every op on the logits' device (tests/test_logits_processors.py's stand-in accelerator)."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine_service.generation.logprobs import TokenLogprobs, token_logprobs
from tests.test_logits_processors import META, Accelerator


def log_softmax(row: list[float]) -> list[float]:
    top = max(row)
    total = math.log(sum(math.exp(x - top) for x in row)) + top
    return [x - total for x in row]


def test_each_row_gives_its_tokens_value_and_the_top_alternatives_most_likely_first() -> None:
    rows = [[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 1.0], [2.0, 1.0, 0.0, 4.0]]
    got = token_logprobs(torch.tensor(rows), [2, 3, 3], 2)
    assert [g.token_id for g in got] == [2, 3, 3]
    for g, row, token in zip(got, rows, [2, 3, 3], strict=True):
        want = log_softmax(row)
        assert math.isclose(g.logprob, want[token], abs_tol=1e-6)
        order = sorted(range(4), key=lambda i: -want[i])[:2]
        assert [t for t, _ in g.top] == order
        assert all(math.isclose(v, want[t], abs_tol=1e-6) for t, v in g.top)
        assert g.top[0][1] >= g.top[1][1]
    assert all(isinstance(g, TokenLogprobs) and isinstance(g.logprob, float) for g in got)


def test_only_as_many_rows_as_tokens_are_read_and_no_top_means_none() -> None:
    logits = torch.tensor([[0.0, 1.0], [9.0, -9.0], [float("nan"), 0.0]])  # the last row is never read
    got = token_logprobs(logits, [1, 0], 0)
    assert [(g.token_id, g.top) for g in got] == [(1, ()), (0, ())]
    assert math.isclose(got[0].logprob, log_softmax([0.0, 1.0])[1], abs_tol=1e-6)
    assert got[1].logprob > -1e-6
    assert token_logprobs(logits, [], 3) == []


def test_bfloat16_logits_are_read_in_float32() -> None:
    rows = torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.bfloat16)
    got = token_logprobs(rows, [0], 3)
    want = log_softmax([float(x) for x in rows[0].float()])
    assert math.isclose(got[0].logprob, want[0], abs_tol=1e-6)
    assert [t for t, _ in got[0].top] == [2, 1, 0]


def test_token_ids_of_any_integer_type_are_read_as_ids() -> None:
    rows = [[1.0, 3.0, 2.0], [0.5, 0.0, -1.0]]
    for tokens in (list(np.array([2, 0], dtype=np.int16)), list(np.array([2, 0], dtype=np.uint8))):
        got = token_logprobs(torch.tensor(rows), tokens, 1)
        assert [(g.token_id, g.top[0][0]) for g in got] == [(2, 1), (0, 0)]
        for g, row, token in zip(got, rows, [2, 0], strict=True):
            assert math.isclose(g.logprob, log_softmax(row)[token], abs_tol=1e-6)


def test_every_op_runs_on_the_logits_device() -> None:
    with Accelerator():  # reads back zeros: what is checked is that no op meets a host tensor
        got = token_logprobs(torch.zeros(3, 5, device=META), [4, 1, 1], 2)
        assert [(g.token_id, g.logprob, g.top) for g in got] == [(t, 0.0, ((0, 0.0), (0, 0.0))) for t in (4, 1, 1)]
        assert [g.top for g in token_logprobs(torch.zeros(2, 5, device=META), [3, 0], 0)] == [(), ()]
