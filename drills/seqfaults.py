"""Per-sequence faults at scale: `--fault sequence-error:rate=0.2,seed=S` across a grid of prompt
lengths and concurrencies, every request with an explicit id. Exactly the requests that
`FaultPlan.dooms(id)` predicts end ABORTED/SEQUENCE_ABORTED (after their first token, which is
valid); every other request produces the same greedy tokens as a clean engine."""

from __future__ import annotations

import itertools
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from drills.common import CallResult, EngineProcess, collect, note
from drills.row import Checks, DrillRow
from engine.v1 import engine_pb2 as pb
from engine_service.faults import FaultPlan

NAME = "seqfaults"
SEED = 11
FAULT = f"sequence-error:rate=0.2,seed={SEED}"
MAX_NEW = 12


@dataclass(frozen=True)
class Case:
    request_id: str
    prompt: tuple[int, ...]
    concurrency: int

    def request(self) -> pb.DecodeRequest:
        return pb.DecodeRequest(request_id=self.request_id, prompt_token_ids=pb.TokenIds(ids=self.prompt),
                                max_new_tokens=MAX_NEW, ignore_eos=True)


def grid(quick: bool) -> list[Case]:
    lengths, concurrencies, total = ([4, 64], [1, 8], 60) if quick else ([4, 32, 128], [1, 4, 16], 200)
    cells = list(itertools.product(lengths, concurrencies))
    rng = random.Random(SEED)
    cases = []
    for n in range(total):
        length, concurrency = cells[n % len(cells)]
        cases.append(Case(f"sf-{length}-{concurrency}-{n}", tuple(rng.randrange(256) for _ in range(length)),
                          concurrency))
    return cases


def run_cases(engine: EngineProcess, cases: list[Case]) -> dict[str, CallResult]:
    """Each cell's requests at that cell's concurrency, cell after cell."""
    stub = engine.stub()
    answers: dict[str, CallResult] = {}
    for concurrency in sorted({c.concurrency for c in cases}):
        for length in sorted({len(c.prompt) for c in cases}):
            cell = [c for c in cases if c.concurrency == concurrency and len(c.prompt) == length]
            with ThreadPoolExecutor(concurrency) as pool:
                for case, answer in zip(cell, pool.map(lambda c: collect(stub.Decode(c.request(), timeout=60)), cell),
                                        strict=True):
                    answers[case.request_id] = answer
    return answers


def run(quick: bool) -> DrillRow:
    cases = grid(quick)
    plan = FaultPlan.parse([FAULT])
    doomed = {c.request_id for c in cases if plan.dooms(c.request_id)}
    checks = Checks()
    # float32: the others' greedy tokens are compared with a clean engine's, and in bfloat16 (what
    # --dtype auto picks on a CPU with native bfloat16) a row may round differently with the batch
    flags = ("--model", "tiny", "--dtype", "float32", "--max-batch", "16", "--max-context", "256")
    clean_engine, faulty_engine = EngineProcess(*flags), EngineProcess(*flags, "--fault", FAULT)
    try:
        for e in (clean_engine, faulty_engine):
            e.start(wait_serving=False)
        for e in (clean_engine, faulty_engine):
            e.wait_serving()
        note(NAME, f"{len(cases)} requests on a clean engine, then with --fault {FAULT} ({len(doomed)} doomed)")
        clean = run_cases(clean_engine, cases)
        faulty = run_cases(faulty_engine, cases)
        load = faulty_engine.wait_load(lambda x: x.running_sequences == 0 and x.kv_cache_used_tokens == 0)
        checks.expect(faulty_engine.health() == 1, "faulty engine not SERVING after the run")
    finally:
        clean_engine.kill()
        faulty_engine.kill()
    checks.expect(load.running_sequences == 0 and load.kv_cache_used_tokens == 0, f"load not back to zero: {load}")
    bad_clean = [rid for rid, a in clean.items() if not (a.ok and len(a.tokens) == MAX_NEW)]
    checks.expect(not bad_clean, f"clean engine failed {bad_clean[:3]}")
    aborted = {rid for rid, a in faulty.items() if a.is_("ABORTED", "SEQUENCE_ABORTED")}
    wrong: list[str] = []
    for case in cases:
        rid, got, want = case.request_id, faulty[case.request_id], clean[case.request_id].tokens
        if rid in doomed:
            if not (got.is_("ABORTED", "SEQUENCE_ABORTED") and got.metadata.get("requestId") == rid
                    and got.metadata.get("generatedTokens") == "1" and got.tokens == want[: len(got.tokens)]):
                wrong.append(f"{rid} (doomed): {got.short()} {dict(got.metadata)}")
        elif not (got.ok and got.tokens == want):
            wrong.append(f"{rid}: {got.short()}, tokens {'equal' if got.tokens == want else 'differ'}")
    checks.expect(bool(doomed) and len(doomed) < len(cases), f"{len(doomed)} doomed of {len(cases)}: not a drill")
    checks.expect(aborted == doomed, f"aborted {len(aborted)} != predicted {len(doomed)}: "
                                     f"unexpected {sorted(aborted - doomed)[:3]}, spared {sorted(doomed - aborted)[:3]}")
    checks.expect(not wrong, f"{len(wrong)} requests off prediction: {wrong[:3]}")
    lengths = sorted({len(c.prompt) for c in cases})
    concurrencies = sorted({c.concurrency for c in cases})
    return checks.row(
        NAME,
        done=f"{len(cases)} greedy requests with explicit ids, prompt lengths {lengths} x concurrency {concurrencies}, "
             f"on a clean engine and on one with --fault {FAULT}",
        expected="exactly the ids FaultPlan.dooms() predicts end ABORTED/SEQUENCE_ABORTED after 1 valid token; "
                 "all others equal the clean run's tokens",
        lost=len(wrong),
        figures={"requests": len(cases), "faults injected": len(doomed), "aborted as predicted": len(aborted & doomed),
                 "others identical": len(cases) - len(doomed) - sum(1 for w in wrong if "(doomed)" not in w)},
    )
