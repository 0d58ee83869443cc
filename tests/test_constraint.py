"""Structured output (engine_service/generation/constraint.py) on SmolLM2's real tokenizer (loaded from the
packaged GGUF's metadata alone, no weights) and on the byte tokenizer of the tiny models.

Random logits stand in for a model: every output the masks let through, greedy (argmax) or sampled
(multinomial), must parse and validate against its JSON schema, fullmatch its regex, or parse with
its Lark grammar; every run must complete (its constraint `done`) within the token cap. Refused
sources must be InvalidField naming the response_format field, with the compiler's message.

What depends on no tokenizer (refusals, argument checks, the compile thread, the bitmask buffer)
runs on the byte tokenizer's compiler, which costs milliseconds to build: a test that needs only it
never waits for SmolLM2's (mutmut's time limit for a mutant leaves out fixtures' setup).
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from structlog.testing import capture_logs
from tokenizers import Tokenizer, models

from engine_service.generation import constraint as constraint_module
from engine_service.generation.constraint import (
    MAX_SOURCE_BYTES,
    Constraint,
    ConstraintCompiler,
    _clip,
    _forbidden,
    _unpack_words,
    apply_masks,
)
from engine_service.model.byte_tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from engine_service.model.gguf_checkpoint import parse_config
from engine_service.model.gguf_reader import read_gguf
from engine_service.model.gguf_tokenizer import build_gguf_tokenizer
from engine_service.model.hf_tokenizer import HFTokenizer
from engine_service.model.presets import PACKAGED
from engine_service.requests import ResponseFormat
from shared.errors import InvalidField, SequenceError

CAP = 400  # tokens per run; every run must finish well within it
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Smol:
    tokenizer: HFTokenizer
    compiler: ConstraintCompiler
    eos: int


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These tensors are small: a second intra-op thread only adds a wait for it, which on a busy
    machine (a descheduled worker) grows to tens of ms per op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smol() -> Smol:
    gguf = read_gguf(PACKAGED["smollm2"].locate("smollm2"))
    config = parse_config(gguf)
    tokenizer = HFTokenizer(build_gguf_tokenizer(gguf), config.vocab_size, config.bos_token_id,
                            config.eos_token_id, kind="gguf")
    compiler = ConstraintCompiler(tokenizer, config.vocab_size, frozenset({config.eos_token_id}))
    return Smol(tokenizer, compiler, config.eos_token_id)


@pytest.fixture(scope="module")
def byte() -> ConstraintCompiler:
    """The tiny models' byte tokenizer: ids 0..255 are bytes, 256 BOS, 257 EOS."""
    return ConstraintCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, frozenset({EOS_ID}))


def allowed(compiler: ConstraintCompiler, constraint: Constraint) -> list[int]:
    """The ids the constraint's mask allows now."""
    logits = apply_masks(torch.zeros(1, compiler.vocab_size), [0], [constraint])
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def wide(smol: Smol) -> ConstraintCompiler:
    """SmolLM2's tokenizer in a model vocabulary 77 ids wider (padding), with two EOS ids."""
    return ConstraintCompiler(smol.tokenizer, smol.compiler.vocab_size + 77, frozenset({0, smol.eos}))


def drive(compiler: ConstraintCompiler, fmt: ResponseFormat, seed: int, cap: int = CAP,
          logits_scale: float = 1.0) -> list[list[int]]:
    """Two runs of `fmt` in one batch, row 0 greedy and row 1 sampled, on random logits: each
    run's tokens (its final EOS, if it consumed one, left out), until its constraint is done. Fails
    when a run is not done within `cap` tokens."""
    generator = torch.Generator().manual_seed(seed)
    constraints = [compiler.compile(fmt, request_id=f"run-{seed}-{i}") for i in range(2)]
    outputs: list[list[int]] = [[], []]
    for _ in range(cap):
        live = [i for i, c in enumerate(constraints) if not c.done]
        if not live:
            break
        logits = torch.randn(len(live), compiler.vocab_size, generator=generator) * logits_scale
        apply_masks(logits, list(range(len(live))), [constraints[i] for i in live])
        for row, i in enumerate(live):
            if i == 0:
                token = int(logits[row].argmax())
            else:  # from the softmax over the allowed tokens (the others' probability is 0)
                allowed = torch.isfinite(logits[row]).nonzero().flatten()
                probs = torch.softmax(logits[row, allowed], dim=-1)
                token = int(allowed[torch.multinomial(probs, 1, generator=generator)])
            constraints[i].consume([token])
            if token not in compiler.eos_token_ids:
                outputs[i].append(token)
    unfinished = [i for i, c in enumerate(constraints) if not c.done]
    assert not unfinished, f"runs {unfinished} of {fmt.source!r} (seed {seed}) not done within {cap} tokens"
    return outputs


SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "address"], "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 10},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": "boolean"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 4}]},
    {"const": "fixed-value"},
    {"type": "array", "maxItems": 2, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
        "properties": {"sku": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}},
    {"type": ["string", "null"], "maxLength": 6},
    {"$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "y": {"type": "integer", "minimum": 0, "maximum": 99}}}},
     "type": "object", "additionalProperties": False, "required": ["start", "end"],
     "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}},
    {"type": "string", "format": "date"},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    {"type": "object", "additionalProperties": False,
     "properties": {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 0, "maximum": 5}}},
    {"enum": [1, "two", None, True, 3.5]},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}],
     "items": False, "minItems": 2},
    {"type": "string", "minLength": 3, "maxLength": 8},
    {"type": "object", "additionalProperties": False,
     "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100}, "ok": {"type": "boolean"}},
     "allOf": [{"required": ["id"]}, {"required": ["ok"], "properties": {"ok": {"const": True}}}]},
    {"type": "object", "additionalProperties": False, "required": ["status", "items"], "properties": {
        "status": {"enum": ["ok", "error"]},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
        "note": {"type": ["string", "null"], "maxLength": 8}}},
]


def test_twenty_schemas() -> None:
    assert len(SCHEMAS) == 20


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_json_schema_outputs_validate(smol: Smol, schema: dict) -> None:
    fmt = ResponseFormat("json_schema", json.dumps(schema))
    for seed in SEEDS:
        for tokens in drive(smol.compiler, fmt, seed):
            text = smol.tokenizer.decode(tokens)
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,2}",
    r"\d{4}-\d{2}-\d{2}",
    r"#[0-9a-f]{6}",
    r"(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)",
]


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_fullmatch(smol: Smol, regex: str) -> None:
    fmt = ResponseFormat("regex", regex)
    for seed in SEEDS:
        for tokens in drive(smol.compiler, fmt, seed):
            text = smol.tokenizer.decode(tokens)
            assert re.fullmatch(regex, text), (regex, text)


LARK = r"""
start: expr
expr: term (("+" | "-") term){0,3}
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


def _parses(text: str) -> bool:
    """`text` is a whole `expr` of LARK, by recursive descent (independent of llguidance)."""
    number = re.compile(r"[0-9]{1,3}")

    def term(at: int) -> int | None:
        if text.startswith("(", at):
            end = expr(at + 1)
            return end + 1 if end is not None and text.startswith(")", end) else None
        found = number.match(text, at)
        return found.end() if found else None

    def expr(at: int) -> int | None:
        end = term(at)
        for _ in range(3):
            if end is None or end >= len(text) or text[end] not in "+-":
                break
            end = term(end + 1)
        return end

    return expr(0) == len(text)


def test_lark_grammar_outputs_parse(smol: Smol) -> None:
    fmt = ResponseFormat("lark_grammar", LARK)
    assert _parses("(1+(2-3))-45") and not _parses("1+2+3+4+5") and not _parses("(1")
    for seed in SEEDS:
        for tokens in drive(smol.compiler, fmt, seed):
            text = smol.tokenizer.decode(tokens)
            assert _parses(text), text


def test_eos_is_allowed_exactly_when_accepting(smol: Smol) -> None:
    """`[0-9]{1,3}`: no EOS before a digit; digits and EOS after one; EOS alone after three, where
    the grammar is complete... and consuming EOS makes it done."""
    constraint = smol.compiler.compile(ResponseFormat("regex", "[0-9]{1,3}"))
    eos, digit = smol.eos, smol.tokenizer.encode("7", add_special_tokens=False)[0]

    def allowed() -> torch.Tensor:
        logits = torch.zeros(1, smol.compiler.vocab_size)
        return torch.isfinite(apply_masks(logits, [0], [constraint])[0])

    assert not allowed()[eos] and allowed()[digit] and not constraint.accepting
    constraint.consume([digit])
    assert allowed()[eos] and allowed()[digit] and constraint.accepting and not constraint.done
    constraint.consume([digit, digit])
    assert constraint.done  # nothing can extend it: STOP, without an EOS
    assert allowed().nonzero().flatten().tolist() == [eos]  # once done, the mask allows EOS alone
    other = smol.compiler.compile(ResponseFormat("regex", "[0-9]{1,3}"))
    with pytest.raises(SequenceError):  # a done matcher takes nothing else
        other.consume([digit] * 4)
    constraint.consume([eos])  # EOS after done is accepted
    assert constraint.done
    constraint = smol.compiler.compile(ResponseFormat("regex", "[0-9]{1,3}"))
    constraint.consume([digit, eos])
    assert constraint.done


def test_every_eos_id_ends_an_accepting_grammar(smol: Smol, wide: ConstraintCompiler) -> None:
    assert wide.eos_token_ids == frozenset({0, smol.eos})
    constraint = wide.compile(ResponseFormat("regex", "ok"))
    constraint.consume(smol.tokenizer.encode("o", add_special_tokens=False))
    logits = apply_masks(torch.zeros(1, wide.vocab_size), [0], [constraint])
    assert not torch.isfinite(logits[0, [0, smol.eos]]).any()
    constraint.consume(smol.tokenizer.encode("k", add_special_tokens=False))
    logits = apply_masks(torch.zeros(1, wide.vocab_size), [0], [constraint])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted({0, smol.eos})
    constraint.consume([0])
    assert constraint.done


def test_padding_ids_past_the_tokenizer_are_masked(smol: Smol, wide: ConstraintCompiler) -> None:
    """A model vocabulary wider than the tokenizer's (padded to a multiple of 64, say): the extra
    ids are never allowed, not even where the grammar allows almost anything."""
    own = smol.compiler.vocab_size
    constraint = wide.compile(ResponseFormat("json_schema", json.dumps({"type": "string"})))
    constraint.consume(smol.tokenizer.encode('"', add_special_tokens=False))
    logits = apply_masks(torch.zeros(2, wide.vocab_size), [1], [constraint])
    assert torch.isfinite(logits[1, :own]).sum() > 10_000  # the string's content
    assert not torch.isfinite(logits[1, own:]).any()
    with pytest.raises(SequenceError, match="refused token"):
        constraint.consume([wide.vocab_size - 1])


def test_mixed_batch_leaves_unconstrained_rows_untouched(smol: Smol) -> None:
    vocab = smol.compiler.vocab_size
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3))
    raw = logits.clone()
    regex = smol.compiler.compile(ResponseFormat("regex", "[0-9]+"))
    schema = smol.compiler.compile(ResponseFormat("json_schema", json.dumps({"type": "boolean"})))
    out = apply_masks(logits, [3, 1], [regex, schema])
    assert out is logits  # in place
    for row in (0, 2, 4):
        assert torch.equal(logits[row], raw[row])
    for row, constraint in ((3, regex), (1, schema)):
        allowed = torch.isfinite(logits[row])
        assert 0 < int(allowed.sum()) < vocab
        assert torch.equal(logits[row][allowed], raw[row][allowed])  # the allowed keep their values
        text = smol.tokenizer.decode([int(logits[row].argmax())])
        assert re.fullmatch("[0-9]+", text) if constraint is regex else "true".startswith(text) or \
            "false".startswith(text), text
    # a contiguous run of rows takes the same masks as the rows one by one
    again = raw.clone()
    apply_masks(again, [1, 2], [schema, smol.compiler.compile(ResponseFormat("regex", "[0-9]+"))])
    assert torch.equal(again[1], logits[1]) and torch.equal(torch.isinf(again[2]), torch.isinf(logits[3]))
    assert torch.equal(apply_masks(raw.clone(), [], []), raw)


def test_bfloat16_logits_take_the_same_masks(smol: Smol) -> None:
    """Logits numpy cannot hold (bfloat16) take torch's masked_fill_: the same tokens masked."""
    constraints = [smol.compiler.compile(ResponseFormat("regex", "[0-9]+")) for _ in range(2)]
    wide = apply_masks(torch.zeros(3, smol.compiler.vocab_size), [0, 2], constraints)
    narrow = apply_masks(torch.zeros(3, smol.compiler.vocab_size, dtype=torch.bfloat16), [0, 2], constraints)
    assert torch.equal(wide, narrow.float()) and not torch.isinf(narrow[1]).any()  # -inf, not +inf


def test_cpu_float32_logits_are_filled_by_numpy_once_per_run_of_rows(byte: ConstraintCompiler,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, float32 logits are filled by numpy on the calling thread (torch's masked_fill_
    would wait on its intra-op threads), with one fill for a run of consecutive rows, one per row
    otherwise; bfloat16 (numpy has none) and logits that need their gradient go to masked_fill_."""
    fills: list[tuple[int, ...]] = []
    copyto = np.copyto

    def counting_copyto(dst: np.ndarray, src: Any, **kwargs: Any) -> None:
        fills.append(dst.shape)
        copyto(dst, src, **kwargs)

    monkeypatch.setattr(np, "copyto", counting_copyto)
    digits = [byte.compile(ResponseFormat("regex", "[0-9]")) for _ in range(3)]
    logits = apply_masks(torch.zeros(5, byte.vocab_size), [1, 2, 3], digits)
    assert fills == [(3, byte.vocab_size)]
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in logits[1:4]] == [list(range(48, 58))] * 3
    fills.clear()
    apply_masks(torch.zeros(5, byte.vocab_size), [4, 0], digits[:2])
    assert fills == [(byte.vocab_size,), (byte.vocab_size,)]
    fills.clear()
    apply_masks(torch.zeros(5, byte.vocab_size, dtype=torch.bfloat16), [1, 2], digits[:2])
    leaf = torch.zeros(2, byte.vocab_size, requires_grad=True)
    needs_grad = apply_masks(leaf * 2, [0], digits[:1])  # numpy cannot write a tensor that needs its grad
    assert fills == [] and torch.isfinite(needs_grad[0]).nonzero().flatten().tolist() == list(range(48, 58))
    assert needs_grad.requires_grad and not torch.isinf(needs_grad[1]).any()


def test_apply_masks_checks_its_arguments(byte: ConstraintCompiler) -> None:
    constraint = byte.compile(ResponseFormat("regex", "a"))
    vocab = byte.vocab_size
    with pytest.raises(ValueError, match="pair up"):
        apply_masks(torch.zeros(2, vocab), [0, 1], [constraint])
    with pytest.raises(ValueError, match="logits must be"):
        apply_masks(torch.zeros(2, 100), [0], [constraint])
    with pytest.raises(ValueError, match=re.escape("rows must be distinct rows of the 2 logits, got [0, 0]")):
        apply_masks(torch.zeros(2, vocab), [0, 0], [constraint, constraint])
    with pytest.raises(ValueError, match="distinct rows"):
        apply_masks(torch.zeros(2, vocab), [2], [constraint])
    other = ConstraintCompiler(ByteTokenizer(), vocab, frozenset({EOS_ID}))  # the bitmask is per compiler
    with pytest.raises(ValueError, match="^constraints from different ConstraintCompilers cannot be masked together$"):
        apply_masks(torch.zeros(2, vocab), [0, 1], [constraint, other.compile(ResponseFormat("regex", "a"))])


def test_device_unpacking_matches_the_cpu_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The unpacking other devices use (shifts made on the words' device) gives the CPU's
    booleans. On the CPU numpy alone unpacks; for another device the words travel there and it
    unpacks them ("meta" stands in for CUDA: tensors without data, so nothing is computed on it)."""
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    arange, shifts_on = torch.arange, []

    def recording_arange(*args: Any, **kwargs: Any) -> torch.Tensor:
        shifts_on.append(kwargs.get("device"))
        return arange(*args, **kwargs)

    monkeypatch.setattr(torch, "arange", recording_arange)
    unpacked = _unpack_words(bitmask, 150)
    assert shifts_on == [bitmask.device]  # on CUDA, shifts left on the CPU would fail the op
    cpu = _forbidden(bitmask, 150, torch.device("cpu"))
    assert cpu.shape == (3, 150) and cpu.dtype == torch.bool and torch.equal(cpu, unpacked)
    for token in (0, 31, 32, 149):  # bit i of word j is token 32 j + i
        assert bool(cpu[1, token]) == (not (int(bitmask[1, token // 32]) >> (token % 32)) & 1)
    travelled: list[tuple[torch.Tensor, int]] = []

    def recording_unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
        travelled.append((words, vocab_size))
        return words

    monkeypatch.setattr(constraint_module, "_unpack_words", recording_unpack)
    assert torch.equal(_forbidden(bitmask, 150, torch.device("cpu")), cpu) and travelled == []  # numpy's
    _forbidden(bitmask, 150, torch.device("meta"))
    [(words, vocab_size)] = travelled
    assert words.device.type == "meta" and words.shape == (3, 5) and words.dtype == torch.int32 and vocab_size == 150


def test_the_shared_bitmask_grows_by_doubling_and_every_row_is_written() -> None:
    """The compiler's one bitmask starts at 8 rows and doubles (at least to the batch) when a batch
    outgrows it; llguidance writes each row a batch reads, so what a buffer held never leaks in."""
    compiler = ConstraintCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, frozenset({EOS_ID}))
    first = compiler._bitmask
    assert first.shape == (8, 9) and first.dtype == torch.int32  # 258 ids: 9 words a row
    assert compiler._bitmask_rows(8).data_ptr() == first.data_ptr() and compiler._bitmask is first
    letters = [compiler.compile(ResponseFormat("regex", chr(97 + i))) for i in range(10)]
    for junk in (0, -1):
        compiler._bitmask.fill_(junk)
        logits = apply_masks(torch.zeros(10, compiler.vocab_size), list(range(10)), letters)
        assert [torch.isfinite(row).nonzero().flatten().tolist() for row in logits] == [[97 + i] for i in range(10)]
        assert compiler._bitmask.shape == (16, 9)
    grown = compiler._bitmask
    assert compiler._bitmask_rows(16).data_ptr() == grown.data_ptr()
    assert compiler._bitmask_rows(17).shape == (17, 9) and compiler._bitmask.shape == (32, 9)
    assert compiler._bitmask_rows(70).shape == (70, 9) and compiler._bitmask.shape == (70, 9)
    stopped = compiler.compile(ResponseFormat("regex", "a"))
    stopped.consume([97])
    broken = compiler.compile(ResponseFormat("regex", "a"))
    broken.matcher.consume_token(98)  # in error: the mask allows EOS alone
    for junk in (0, -1):
        compiler._bitmask.fill_(junk)
        assert allowed(compiler, stopped) == [EOS_ID] and allowed(compiler, broken) == [EOS_ID]


def test_the_bitmask_is_pinned_when_cuda_is_there_and_plain_when_pinning_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned buffer copies to the GPU faster; where pinning fails, a plain one serves."""
    pinning: list[object] = []
    empty = torch.empty

    def pin_fails(*args: Any, **kwargs: Any) -> torch.Tensor:
        pinning.append(kwargs.get("pin_memory"))
        if kwargs.get("pin_memory"):
            raise RuntimeError("cannot pin memory here")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", pin_fails)
    compiler = ConstraintCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, frozenset({EOS_ID}))
    assert pinning == [True, None]
    assert compiler._bitmask.shape == (8, 9) and compiler._bitmask.dtype == torch.int32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pinning.clear()
    compiler._bitmask_rows(9)
    assert pinning == [False] and compiler._bitmask.shape == (16, 9)


def test_consume_counts_tokens_and_names_a_request_without_an_id(byte: ConstraintCompiler) -> None:
    constraint = byte.compile(ResponseFormat("regex", "abc"))
    assert constraint.request_id == "" and constraint.consumed == 0
    constraint.consume([97])
    assert constraint.consumed == 1
    constraint.consume([98, 99])
    assert constraint.consumed == 3 and constraint.done
    with pytest.raises(SequenceError) as caught:
        constraint.consume([100])
    assert caught.value.metadata["requestId"] == "(request id not given to compile)"
    assert caught.value.metadata["generatedTokens"] == "3" and constraint.consumed == 3


def test_consume_of_a_forbidden_token_aborts_the_sequence(smol: Smol) -> None:
    constraint = smol.compiler.compile(ResponseFormat("regex", "[0-9]+"), request_id="req-7")
    constraint.consume(smol.tokenizer.encode("12", add_special_tokens=False))
    letter = smol.tokenizer.encode("x", add_special_tokens=False)[0]
    with pytest.raises(SequenceError) as caught:
        constraint.consume([letter])
    err = caught.value
    assert err.metadata["requestId"] == "req-7" and err.metadata["generatedTokens"] == str(constraint.consumed)
    assert f"response_format.regex constraint refused token {letter}" in err.message
    with pytest.raises(SequenceError):  # the matcher stays broken
        constraint.consume(smol.tokenizer.encode("3", add_special_tokens=False))


def _refusal(compiler: ConstraintCompiler, kind: str, source: str) -> InvalidField:
    with pytest.raises(InvalidField) as caught:
        compiler.compile(ResponseFormat(kind, source))
    err = caught.value
    assert err.field == f"response_format.{kind}" and err.metadata["field"] == err.field
    return err


def test_clip_makes_one_line_of_at_most_300_characters() -> None:
    assert _clip(" a\n\n b<non-verbose/>c\t") == "a b c"
    assert _clip("x" * 300) == "x" * 300
    assert _clip("x" * 301) == "x" * 297 + "..."


@pytest.mark.parametrize(("kind", "source", "message"), [
    ("json_schema", '{"type": "object", "properties": {', "invalid JSON: Expecting property name enclosed in "
                                                          "double quotes: line 1 column 35"),
    ("json_schema", "{'type': 'string'}", "invalid JSON"),
    ("json_schema", '{"type": "number", "maximum": NaN}', "invalid JSON: NaN is not JSON"),
    ("json_schema", "[1, 2]", "a JSON schema must be an object (or true), got an array"),
    ("json_schema", '"string"', "a JSON schema must be an object (or true), got a string"),
    ("json_schema", "false", "got false"),
    ("json_schema", "null", "got null"),
    ("json_schema", "4.5", "got a number"),
    ("json_schema", '{"type": "number", "maximum": 1e400}', "number out of range"),  # Python's json takes it
    ("json_schema", "   ", "invalid JSON: Expecting value"),
    ("json_schema", '{"type": "strin"}', "Invalid type: strin"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', 'Unimplemented keys: ["uniqueItems"]'),
    ("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}', "minLength (5) is greater than maxLength"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "/$defs/missing"),
    ("json_schema", '{"type": "string", "pattern": "(ab"}', "unclosed group"),
    ("json_schema", '{"type": "string", "format": "postcode"}', "Unknown format: postcode"),
    ("regex", "a(b", "unclosed group"),
    ("regex", "(?=a)a", "look-around"),
    ("regex", r"(a)\1", "backreferences are not supported"),
    ("regex", r"[^\s\S]", "the grammar allows no output"),
    ("lark_grammar", "start: ???", "Expected value"),
    ("lark_grammar", "rule: \"a\"", "start"),
    ("lark_grammar", "   \n", "Empty grammar"),
])
def test_refused_sources_name_the_field_and_the_compiler_message(byte: ConstraintCompiler, kind: str, source: str,
                                                                 message: str) -> None:
    err = _refusal(byte, kind, source)
    assert err.message.startswith(f"response_format.{kind} was refused by the grammar compiler: "), err.message
    assert message in err.message, err.message
    assert err.metadata["value"] == source
    assert len(err.message) <= len(f"response_format.{kind} was refused by the grammar compiler: ") + 300
    assert "\n" not in err.message


def test_empty_and_oversized_sources_are_refused_before_compiling(byte: ConstraintCompiler) -> None:
    for kind in ("json_schema", "regex", "lark_grammar"):
        err = _refusal(byte, kind, "")
        assert err.message == f"response_format.{kind} must not be empty, got ''" and err.metadata["value"] == ""
    big = json.dumps({"enum": ["x" * 100] * 700})
    err = _refusal(byte, "json_schema", big)
    assert err.message == (f"response_format.json_schema must be at most {MAX_SOURCE_BYTES} bytes (UTF-8), "
                           f"got {len(big)} bytes")
    assert err.metadata["value"] == f"{len(big)} bytes"
    err = _refusal(byte, "regex", "é" * (MAX_SOURCE_BYTES // 2 + 1))  # counted in bytes
    assert f"got {MAX_SOURCE_BYTES + 2} bytes" in err.message
    at_the_bound = '{"type": "string"}' + " " * (MAX_SOURCE_BYTES - 18)
    assert len(at_the_bound.encode()) == MAX_SOURCE_BYTES
    byte.compile(ResponseFormat("json_schema", at_the_bound))
    with pytest.raises(InvalidField) as caught:
        byte.compile(ResponseFormat("xml", "<a/>"))
    err = caught.value
    assert err.field == "response_format" and err.metadata["field"] == "response_format"
    assert err.metadata["value"] == "xml"
    assert err.message == "response_format must be one of json_schema, regex, lark_grammar, got 'xml'"


def test_grammar_warnings_are_logged_and_llguidance_writes_nothing(byte: ConstraintCompiler,
                                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """A grammar's warnings (a lenient schema's unimplemented keys, say) are logged once, at
    compile; llguidance's own log (its warning on a refused token) stays off stderr."""
    lenient = json.dumps({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}})
    with capture_logs() as logs:
        byte.compile(ResponseFormat("json_schema", lenient), request_id="req-w")
        byte.compile(ResponseFormat("regex", "ab"), request_id="req-quiet")
    assert logs == [{"event": "grammar_warnings", "log_level": "info", "request_id": "req-w",
                     "field": "response_format.json_schema", "warnings": ['Unimplemented keys: ["uniqueItems"]']}]
    constraint = byte.compile(ResponseFormat("regex", "ab"))
    with pytest.raises(SequenceError):
        constraint.consume([120])
    assert capfd.readouterr().err == ""


def test_a_grammar_of_the_empty_output_allows_eos_alone(byte: ConstraintCompiler) -> None:
    constraint = byte.compile(ResponseFormat("regex", "()"))
    assert constraint.accepting and not constraint.done and allowed(byte, constraint) == [EOS_ID]
    constraint.consume([EOS_ID])
    assert constraint.done


def test_long_values_are_clipped_in_the_error(smol: Smol) -> None:
    source = '{"type": "object", "properties": {' + ", ".join(f'"k{i}": {{"type": "integr"}}' for i in range(200)) + "}}"
    err = _refusal(smol.compiler, "json_schema", source)
    assert len(err.metadata["value"]) <= 64 and "Invalid type: integr" in err.message


def test_a_schema_of_true_is_any_json_and_x_guidance_may_relax_whitespace(smol: Smol) -> None:
    anything = smol.compiler.compile(ResponseFormat("json_schema", "true"))
    anything.consume(smol.tokenizer.encode('[1, "a", {"b": null}]', add_special_tokens=False))
    assert anything.accepting
    compact = smol.compiler.compile(ResponseFormat("json_schema", '{"type": "object"}'))
    with pytest.raises(SequenceError):
        compact.consume(smol.tokenizer.encode("{\n", add_special_tokens=False))
    flexible = smol.compiler.compile(ResponseFormat(
        "json_schema", '{"type": "object", "x-guidance": {"whitespace_flexible": true}}'))
    flexible.consume(smol.tokenizer.encode('{\n  "a": 1\n}', add_special_tokens=False))
    assert flexible.accepting


def test_deep_rule_chains_compile_without_overflowing_the_stack(smol: Smol) -> None:
    """llguidance recurses once per rule of a chain: a 64 KiB Lark chain overflows an 8 MiB stack
    (SIGSEGV, the whole process), so compiling runs on a thread with a larger one."""
    names = [f"r{i}" for i in range(4500)]
    lines = ["start: r0", *(f"{a}: {b}" for a, b in zip(names, names[1:], strict=False)), f'{names[-1]}: "y"']
    source = "\n".join(lines)
    assert len(source) <= MAX_SOURCE_BYTES
    constraint = smol.compiler.compile(ResponseFormat("lark_grammar", source))
    constraint.consume(smol.tokenizer.encode("y", add_special_tokens=False))
    assert constraint.done


def test_pathological_regex_is_refused_at_admission(smol: Smol) -> None:
    """A regex past the lexer's limits errs only when a first token is consumed: the compiler's
    probe finds it, so the request is refused rather than aborted mid-decode."""
    err = _refusal(smol.compiler, "regex", "x((a{100}){100}){100}")
    assert "too many expressions" in err.message


async def test_compile_async(byte: ConstraintCompiler) -> None:
    constraint = await byte.compile_async(ResponseFormat("regex", "[ab]{2}"), request_id="req-async")
    assert isinstance(constraint, Constraint) and not constraint.done and constraint.request_id == "req-async"
    assert allowed(byte, constraint) == [97, 98]
    assert (await byte.compile_async(ResponseFormat("regex", "a"))).request_id == ""
    with pytest.raises(InvalidField):
        await byte.compile_async(ResponseFormat("regex", "a("))


def test_the_compile_thread_is_one_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """One daemon thread, started on first use, runs the jobs in order, hands each job's exception
    to its caller and skips a job cancelled before it ran; a forked child (its thread's pid is
    not the process's) starts its own."""
    monkeypatch.setattr(constraint_module, "_compile_thread", None)
    worker = constraint_module._compile_worker()
    assert constraint_module._compile_worker() is worker and worker.pid == os.getpid()

    def whoami() -> tuple[str, bool]:
        return threading.current_thread().name, threading.current_thread().daemon

    assert worker.submit(whoami).result(timeout=10) == ("constraint-compiler", True)
    with pytest.raises(KeyError, match="missing"):
        worker.submit(lambda: {}["missing"]).result(timeout=10)
    gate, ran = threading.Event(), []
    blocked = worker.submit(gate.wait)
    cancelled = worker.submit(lambda: ran.append("cancelled"))
    assert cancelled.cancel()
    after = worker.submit(lambda: "after")
    gate.set()
    assert blocked.result(timeout=10) is True and after.result(timeout=10) == "after" and ran == []
    monkeypatch.setattr(worker, "pid", -1)  # as a forked child sees its parent's thread
    child = constraint_module._compile_worker()
    assert child is not worker and child.pid == os.getpid() and constraint_module._compile_worker() is child


def test_byte_tokenizer_regex(byte: ConstraintCompiler) -> None:
    """The tiny models' byte tokenizer: ids 0..255 are bytes, 256 BOS, 257 EOS."""
    tokenizer, compiler = ByteTokenizer(), byte
    assert compiler.eos_token_ids == frozenset({EOS_ID})
    regex = r"[0-9]{3}-[a-z]{2,5}( ok)?"
    for seed in SEEDS:
        for tokens in drive(compiler, ResponseFormat("regex", regex), seed):
            assert all(t < 256 for t in tokens)
            assert re.fullmatch(regex, tokenizer.decode(tokens)), tokenizer.decode(tokens)
    constraint = compiler.compile(ResponseFormat("regex", "é"))  # two bytes, two tokens
    constraint.consume(list("é".encode()))
    assert constraint.done
    json_out = drive(compiler, ResponseFormat("json_schema", json.dumps(SCHEMAS[0])), seed=0)
    for tokens in json_out:
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMAS[0])


def test_byte_tokenizer_special_tokens_by_name_and_its_encoder(byte: ConstraintCompiler) -> None:
    """A Lark grammar names the byte tokenizer's special tokens <bos> and <eos>; llguidance
    encodes a string through the vocabulary's encoder, as UTF-8 bytes."""
    constraint = byte.compile(ResponseFormat("lark_grammar", 'start: "a" <bos> "b" <eos>'))
    assert allowed(byte, constraint) == [97]
    constraint.consume([97])
    assert allowed(byte, constraint) == [BOS_ID]
    constraint.consume([BOS_ID, 98])
    assert allowed(byte, constraint) == [EOS_ID] and not constraint.accepting
    constraint.consume([EOS_ID])
    assert constraint.done
    assert byte.ll_tokenizer.tokenize_str("é<eos>") == [*"é<eos>".encode()]
    assert ConstraintCompiler(ByteTokenizer(), 258, frozenset()).eos_token_ids == frozenset({EOS_ID})  # its own


def test_compiler_refuses_what_it_cannot_index() -> None:
    base = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    base.add_special_tokens(["<eos>"])  # id 3, past the model's own 3 ids
    with pytest.raises(ValueError, match="^vocab_size 3 is smaller than the tokenizer's 4 tokens$"):
        ConstraintCompiler(HFTokenizer(base, 4, None, 3), 3, frozenset({2}))
    with pytest.raises(ValueError, match=re.escape("eos_token_ids must be < vocab_size 258, got [258]")):
        ConstraintCompiler(ByteTokenizer(), 258, frozenset({258}))
    with pytest.raises(ValueError, match="eos_token_ids"):
        ConstraintCompiler(ByteTokenizer(), 258, frozenset({300}))
    with pytest.raises(TypeError, match="^structured output needs an HFTokenizer or the ByteTokenizer, got object$"):
        ConstraintCompiler(object(), 258, frozenset({257}))  # type: ignore[arg-type]
