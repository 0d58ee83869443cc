"""Bad input fuzz: hypothesis-generated DecodeRequests (NaN and infinite floats, huge integers,
empty and huge prompts, unicode, token ids at and past the vocabulary, unset oneofs, unknown fields)
and raw garbage bytes, all sent as bytes on the Decode method path. Every answer must be OK or
INVALID_ARGUMENT (INVALID_FIELD with a BadRequest field violation, or CONTEXT_LENGTH_EXCEEDED);
meanwhile well-formed greedy requests on another connection keep producing the same tokens."""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drills.common import DECODE_METHOD, Answer, EngineProcess, collect, note
from drills.row import Checks, Row
from engine.v1 import engine_pb2 as pb

NAME = "fuzz"
VOCAB = 258  # the tiny preset's byte tokenizer: 256 bytes + BOS + EOS
MAX_CONTEXT = 256
MAX_NEW = 8
GOOD_PROMPTS = ("steady one", "steady two, a little longer", "3")

u32 = st.integers(0, 2**32 - 1)
f32 = st.floats(allow_nan=True, allow_infinity=True, width=32)
huge_text = st.builds(lambda ch, n: ch * n, st.characters(), st.integers(MAX_CONTEXT, 70 * MAX_CONTEXT))


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid about four times in five, so that enough requests pass the boundary and decode."""
    return st.integers(0, 9).flatmap(lambda i: invalid if i in (3, 7) else valid)


token_ids = mostly(st.integers(0, VOCAB - 1), st.one_of(st.integers(VOCAB - 2, VOCAB + 2), u32))
prompts = mostly(
    st.one_of(st.tuples(st.just("text"), st.text(min_size=1, max_size=200)),
              st.tuples(st.just("ids"), st.lists(token_ids, min_size=1, max_size=64))),
    st.one_of(st.tuples(st.just("unset"), st.none()), st.tuples(st.just("text"), st.text(max_size=1)),
              st.tuples(st.just("text"), huge_text), st.tuples(st.just("ids"), st.lists(token_ids, max_size=1)),
              st.tuples(st.just("ids"), st.lists(token_ids, min_size=MAX_CONTEXT - 8, max_size=MAX_CONTEXT + 8))),
)
sampling = st.builds(
    pb.SamplingParams,
    temperature=mostly(st.floats(0, 2, width=32), f32),
    top_p=mostly(st.floats(0, 1, width=32), f32),
    top_k=mostly(st.integers(0, VOCAB), st.integers(-(2**31), 2**31 - 1)),
    seed=st.integers(0, 2**64 - 1),
)


@st.composite
def requests(draw: st.DrawFn) -> pb.DecodeRequest:
    msg = pb.DecodeRequest(
        request_id=draw(mostly(st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True)),
                               st.text(max_size=200))),
        max_new_tokens=draw(mostly(st.integers(1, MAX_NEW), st.one_of(st.just(0), u32))),
        stop_token_ids=draw(st.lists(token_ids, max_size=3)),
        ignore_eos=draw(st.booleans()),
    )
    kind, prompt = draw(prompts)
    if kind == "text":
        msg.prompt_text = prompt
    elif kind == "ids":
        msg.prompt_token_ids.ids.extend(prompt)
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(sampling))
    return msg


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def unknown_fields(draw: st.DrawFn) -> bytes:
    """Tagged fields the schema does not know (or known numbers with another wire type)."""
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        number, wire = draw(st.integers(1, 2**29 - 1)), draw(st.sampled_from([0, 1, 2, 5]))
        payload = {0: _varint(draw(st.integers(0, 2**64 - 1))), 1: draw(st.binary(min_size=8, max_size=8)),
                   5: draw(st.binary(min_size=4, max_size=4))}.get(wire)
        if payload is None:
            blob = draw(st.binary(max_size=64))
            payload = _varint(len(blob)) + blob
        parts.append(_varint(number << 3 | wire) + payload)
    return b"".join(parts)


messages = requests().map(lambda m: m.SerializeToString())
cases = st.one_of(st.tuples(st.just("message"), messages),
                  st.tuples(st.just("unknown_fields"), st.builds(lambda m, extra: m + extra, messages, unknown_fields())))
garbage = st.tuples(st.just("garbage"), st.binary(max_size=2048))


# Cases earlier runs found, sent first in every run (quick ones too). A subnormal temperature
# (5.7e-44) once overflowed the sampler to NaN and crashed the engine.
REGRESSIONS = [
    ("message", b"\x12\x02\xc3\xb7 \x05*\x10\r)\x00\x00\x00\x15)\x00\x00\x00\x18\xff\x01 \xceu"),
]


def acceptable(answer: Answer) -> bool:
    """The contract for bad input: OK, or INVALID_ARGUMENT with a field violation or a context limit."""
    if answer.ok:
        return all(t < VOCAB for t in answer.tokens)
    if answer.is_("INVALID_ARGUMENT", "INVALID_FIELD"):
        return bool(answer.field)
    return answer.is_("INVALID_ARGUMENT", "CONTEXT_LENGTH_EXCEEDED")


class Steady(threading.Thread):
    """Well-formed greedy requests on their own connection, compared with a baseline."""

    def __init__(self, address: str, baseline: dict[str, tuple[int, ...]]) -> None:
        super().__init__(daemon=True)
        self.address, self.baseline = address, baseline
        self.stop = threading.Event()
        self.sent = 0
        self.wrong: list[str] = []

    def run(self) -> None:
        with grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            decode = ch.unary_stream(DECODE_METHOD, request_serializer=pb.DecodeRequest.SerializeToString,
                                     response_deserializer=pb.DecodeResponse.FromString)
            while not self.stop.is_set():
                prompt = GOOD_PROMPTS[self.sent % len(GOOD_PROMPTS)]
                got = collect(decode(good_request(prompt), timeout=30))
                self.sent += 1
                if not got.ok or got.tokens != self.baseline[prompt]:
                    self.wrong.append(f"{prompt!r}: {got.short()}")


def good_request(prompt: str) -> pb.DecodeRequest:
    return pb.DecodeRequest(prompt_text=prompt, max_new_tokens=MAX_NEW, ignore_eos=True)


def run(quick: bool) -> Row:
    n_cases = 300 if quick else 2000
    checks = Checks()
    kinds: Counter[str] = Counter()
    answers: Counter[str] = Counter()
    bad: list[str] = []
    # float32: greedy tokens compared with the same prompt's alone must not depend on the batch
    with EngineProcess("--model", "tiny", "--dtype", "float32", "--max-batch", "8", "--max-context", str(MAX_CONTEXT),
                       "--max-new-tokens", str(MAX_NEW)) as engine, engine.channel() as channel:
        decode_raw = channel.unary_stream(DECODE_METHOD, request_serializer=None,
                                          response_deserializer=pb.DecodeResponse.FromString)
        baseline = {p: collect(decode_raw(good_request(p).SerializeToString(), timeout=30)).tokens
                    for p in GOOD_PROMPTS}
        steady = Steady(engine.address, baseline)
        steady.start()
        started = time.monotonic()

        def send(case: tuple[str, bytes]) -> None:
            kind, raw = case
            got = collect(decode_raw(raw, timeout=30))
            kinds[kind] += 1
            answers[f"{got.code}/{got.reason}" if got.reason else got.code] += 1
            if not acceptable(got):
                bad.append(f"{kind} {raw[:60]!r}: {got.short()}")

        def fuzz(strategy: st.SearchStrategy, examples: int) -> None:
            settings(max_examples=examples, database=None, deadline=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))(given(strategy)(send))()

        note(NAME, f"{n_cases} cases with well-formed requests alongside")
        for case in REGRESSIONS:
            send(case)
        fuzz(cases, n_cases - n_cases // 5)
        fuzz(garbage, n_cases // 5)
        # Past the receive limit (4 MiB by default) gRPC itself answers RESOURCE_EXHAUSTED: the contract says so.
        oversize = collect(decode_raw(b"\x12" + b"\xff\xff\xff\x02" + b"x" * (5 << 20), timeout=30))
        elapsed = time.monotonic() - started
        steady.stop.set()
        steady.join(60)
        alive = engine.proc is not None and engine.proc.poll() is None
        checks.expect(alive, f"engine exited with {engine.proc.returncode if engine.proc else '?'}")
        if alive:
            checks.expect(engine.health() == 1, "health not SERVING after the fuzz")
            load = engine.wait_load(lambda x: x.running_sequences == 0 and x.kv_cache_used_tokens == 0)
            checks.expect(load.running_sequences == 0 and load.kv_cache_used_tokens == 0,
                          f"load not back to zero: {load}")
        internal = len(engine.events_named("request_internal_error"))
    cases_run = sum(kinds.values())
    checks.expect(cases_run >= n_cases, f"only {cases_run} of {n_cases} cases ran")
    checks.expect(not bad, f"{len(bad)} answers outside the contract, e.g. {bad[:3]}")
    checks.expect(oversize.code == "RESOURCE_EXHAUSTED", f"5 MiB request answered {oversize.short()}")
    checks.expect(internal == 0, f"{internal} request_internal_error events in the engine log")
    checks.expect(steady.sent > 0, "no well-formed request ran during the fuzz")
    checks.expect(not steady.wrong, f"well-formed requests disturbed: {steady.wrong[:3]}")
    return checks.row(
        NAME,
        done=f"{cases_run} hypothesis cases ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}) as raw bytes "
             f"on Decode, plus one 5 MiB message; {steady.sent} well-formed greedy requests alongside",
        expected="each answer OK, or INVALID_ARGUMENT with INVALID_FIELD + BadRequest or CONTEXT_LENGTH_EXCEEDED; "
                 "never UNKNOWN or a crash; 5 MiB: RESOURCE_EXHAUSTED; well-formed tokens unchanged",
        lost=len(steady.wrong),
        figures={"cases fuzzed": cases_run, "answers": dict(sorted(answers.items())),
                 "well-formed requests": steady.sent, "seconds": round(elapsed, 1)},
    )
