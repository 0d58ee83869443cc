"""Structured output (engine_service/constraint.py) on SmolLM2's real tokenizer (loaded from the
packaged GGUF's metadata alone, no weights) and on the byte tokenizer of the tiny models.

Random logits stand in for a model: every output the masks let through, greedy (argmax) or sampled
(multinomial), must parse and validate against its JSON schema, fullmatch its regex, or parse with
its Lark grammar; every run must complete (its constraint `done`) within the token cap. Refused
sources must be InvalidField naming the response_format field, with the compiler's message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

import jsonschema
import pytest
import torch

from engine_service.constraint import MAX_SOURCE_BYTES, Constraint, ConstraintCompiler, _forbidden, apply_masks
from engine_service.model.byte_tokenizer import EOS_ID, ByteTokenizer
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
    assert torch.equal(torch.isinf(wide), torch.isinf(narrow)) and not torch.isinf(narrow[1]).any()


def test_apply_masks_checks_its_arguments(smol: Smol) -> None:
    constraint = smol.compiler.compile(ResponseFormat("regex", "a"))
    with pytest.raises(ValueError, match="pair up"):
        apply_masks(torch.zeros(2, smol.compiler.vocab_size), [0, 1], [constraint])
    with pytest.raises(ValueError, match="logits must be"):
        apply_masks(torch.zeros(2, 100), [0], [constraint])
    with pytest.raises(ValueError, match="distinct rows"):
        apply_masks(torch.zeros(2, smol.compiler.vocab_size), [0, 0], [constraint, constraint])
    with pytest.raises(ValueError, match="distinct rows"):
        apply_masks(torch.zeros(2, smol.compiler.vocab_size), [2], [constraint])


def test_device_unpacking_matches_the_cpu_one() -> None:
    """The unpacking other devices use (shifts on the device), run here on the CPU's tensors."""
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    cpu = _forbidden(bitmask, 150, torch.device("cpu"))
    words = bitmask.unsqueeze(-1)
    shifted = (((words >> torch.arange(32, dtype=torch.int32)) & 1) == 0).view(3, -1)[:, :150]
    assert cpu.shape == (3, 150) and torch.equal(cpu, shifted)
    for token in (0, 31, 32, 149):  # bit i of word j is token 32 j + i
        assert bool(cpu[1, token]) == (not (int(bitmask[1, token // 32]) >> (token % 32)) & 1)


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


@pytest.mark.parametrize(("kind", "source", "message"), [
    ("json_schema", '{"type": "object", "properties": {', "invalid JSON: Expecting property name enclosed in "
                                                          "double quotes: line 1 column 35"),
    ("json_schema", "{'type': 'string'}", "invalid JSON"),
    ("json_schema", '{"type": "number", "maximum": NaN}', "invalid JSON: NaN is not JSON"),
    ("json_schema", "[1, 2]", "a JSON schema must be an object (or true), got an array"),
    ("json_schema", '"string"', "a JSON schema must be an object (or true), got a string"),
    ("json_schema", "false", "got false"),
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
def test_refused_sources_name_the_field_and_the_compiler_message(smol: Smol, kind: str, source: str,
                                                                 message: str) -> None:
    err = _refusal(smol.compiler, kind, source)
    assert err.message.startswith(f"response_format.{kind} was refused by the grammar compiler: "), err.message
    assert message in err.message, err.message
    assert len(err.message) <= len(f"response_format.{kind} was refused by the grammar compiler: ") + 300
    assert "\n" not in err.message


def test_empty_and_oversized_sources_are_refused_before_compiling(smol: Smol) -> None:
    for kind in ("json_schema", "regex", "lark_grammar"):
        err = _refusal(smol.compiler, kind, "")
        assert err.message == f"response_format.{kind} must not be empty, got ''"
    big = json.dumps({"enum": ["x" * 100] * 700})
    err = _refusal(smol.compiler, "json_schema", big)
    assert err.message == (f"response_format.json_schema must be at most {MAX_SOURCE_BYTES} bytes (UTF-8), "
                           f"got {len(big)} bytes")
    assert err.metadata["value"] == f"{len(big)} bytes"
    err = _refusal(smol.compiler, "regex", "é" * (MAX_SOURCE_BYTES // 2 + 1))  # counted in bytes
    assert f"got {MAX_SOURCE_BYTES + 2} bytes" in err.message
    with pytest.raises(InvalidField, match="response_format must be one of"):
        smol.compiler.compile(ResponseFormat("xml", "<a/>"))


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


async def test_compile_async(smol: Smol) -> None:
    constraint = await smol.compiler.compile_async(ResponseFormat("regex", "[ab]{2}"))
    assert isinstance(constraint, Constraint) and not constraint.done
    with pytest.raises(InvalidField):
        await smol.compiler.compile_async(ResponseFormat("regex", "a("))


def test_byte_tokenizer_regex() -> None:
    """The tiny models' byte tokenizer: ids 0..255 are bytes, 256 BOS, 257 EOS."""
    tokenizer = ByteTokenizer()
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size, frozenset({EOS_ID}))
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


def test_compiler_refuses_what_it_cannot_index(smol: Smol) -> None:
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        ConstraintCompiler(smol.tokenizer, 1000, frozenset({2}))
    with pytest.raises(ValueError, match="eos_token_ids"):
        ConstraintCompiler(ByteTokenizer(), 258, frozenset({300}))
    with pytest.raises(TypeError):
        ConstraintCompiler(object(), 258, frozenset({257}))  # type: ignore[arg-type]
