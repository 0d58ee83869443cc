"""A request's Controls alone, in-process: what it keeps from its request, the text and the finish
each accepted token gives, and the tokens min_new_tokens holds back (generation/controls.py)."""

from __future__ import annotations

import torch

from engine_service.generation.controls import Controls, FinishReason
from engine_service.generation.output_text import OutputText
from engine_service.requests import Request, SamplingParams

EOS = 9


class Letters:
    """Token i's text is the letter chr(97 + i)."""

    def step(self, ids: tuple[int, ...]) -> str:
        return "".join(chr(97 + i) for i in ids)


def request(max_new: int = 4, stop: frozenset[int] = frozenset(), min_new: int = 0, **sampling: float) -> Request:
    return Request(request_id="r", prompt_ids=(1, 2, 3), max_new_tokens=max_new,
                   sampling=SamplingParams(min_new_tokens=min_new, **sampling), stop_token_ids=stop,
                   ignore_eos=False, deadline=None)


def test_controls_keep_the_text_and_constraint_they_are_built_with() -> None:
    text, constraint = OutputText(Letters()), object()
    controls = Controls(request(), text, constraint)  # type: ignore[arg-type]
    assert controls.text is text and controls.constraint is constraint and not controls.plain
    assert Controls(request()).plain and Controls(request()).text is None


def test_the_last_token_releases_its_own_text_and_the_held_back_tail() -> None:
    controls = Controls(request(max_new=2), OutputText(Letters(), stop=["bx"]))
    assert controls.accept(0, 1, frozenset({EOS})) == ("a", None)
    # "b" may start the stop string "bx": held back, then released with the end (length)
    assert controls.accept(1, 2, frozenset({EOS})) == ("b", FinishReason.LENGTH)


def test_a_finishing_token_whose_text_is_partly_released_keeps_both_parts() -> None:
    controls = Controls(request(max_new=2), OutputText(Letters(), stop=["ab", "cd"]))
    assert controls.accept(2, 1, frozenset()) == ("", None)  # "c" held back: it may start "cd"
    # "ca": "c" starts no stop string now and is released; "a" may start "ab", held, then released
    # with the end: both parts in this token's text
    assert controls.accept(0, 2, frozenset()) == ("ca", FinishReason.LENGTH)


def test_each_finish_reason_in_its_order() -> None:
    ends = frozenset({EOS})
    assert Controls(request(stop=frozenset({EOS}))).accept(EOS, 1, ends) == ("", FinishReason.STOP)
    assert Controls(request()).accept(EOS, 1, ends) == ("", FinishReason.EOS)
    assert Controls(request(max_new=1)).accept(4, 1, ends) == ("", FinishReason.LENGTH)
    assert Controls(request(max_new=2)).accept(4, 1, ends) == ("", None)


def test_min_new_tokens_holds_back_eos_and_stop_tokens_until_reached() -> None:
    controls = Controls(request(stop=frozenset({5}), min_new=2))
    assert controls.banned(0, frozenset({EOS})) == {EOS, 5}
    assert controls.banned(1, frozenset({EOS})) == {EOS, 5}
    assert controls.banned(2, frozenset({EOS})) == frozenset()
    constrained = Controls(request(stop=frozenset({5}), min_new=2), constraint=object())  # type: ignore[arg-type]
    assert constrained.banned(0, frozenset({EOS})) == {5}  # a grammar's EOS is the grammar's to allow


def test_start_makes_the_generator_and_asks_the_vocabulary_only_for_penalties() -> None:
    asked: list[int] = []

    def vocab() -> int:
        asked.append(1)
        return 16

    plain = Controls(request())
    plain.start(torch.device("cpu"), vocab)
    assert plain.generator is None and plain.penalties is None and asked == []
    penalized = Controls(request(temperature=1.0, seed=3, repetition_penalty=1.5))
    penalized.start(torch.device("cpu"), vocab)
    assert penalized.generator is not None and penalized.generator.initial_seed() == 3
    assert penalized.penalties is not None and asked == [1]
