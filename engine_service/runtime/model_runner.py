"""Runs the model for one step of the decode loop: one token for each decoding row, and this
step's prompt chunks, in one pass over the weights, as the step's plan lays them out
(scheduling/step_plan.py). A step with no chunk, the steady state, runs the traced decode
(traced_decode.py), or at one row the compiled one where it is on (compiled_decode.py); a step of
decoding rows beside one prompt chunk, what a long prompt arriving among running streams makes,
runs traced too (TracedMixed). A layer-sliced prompt chunk (step_plan.SublayerSpan) runs after the
decoding rows' step, alone through this step's span of the layers; the runner holds its output
between steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import partial

import structlog
import torch

from engine_service.model.compiled_decode import CompiledDecode, cache_dir
from engine_service.model.kv_cache import KVCache, PromptChunk
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.quantize import quantize_model
from engine_service.model.traced_decode import TracedDecode, TracedMixed, TracedVerify
from engine_service.scheduling.prefill_budget import MAX_SLICE_TOKENS, MIN_SLICE_TOKENS, SLICE_BUCKET
from engine_service.scheduling.sequence import Sequence
from engine_service.scheduling.step_plan import DecodeRow, PlanError, Prefill, StepPlan

log = structlog.get_logger()

# a sliced chunk runs padded to whole buckets where a row count oneDNN has not seen costs a layer's
# four projections this much or more the first time (warm_sliced_prefill). Measured: 30-45 ms a
# count on the Xeon 207 with AMX; on an AMD EPYC of the Zen 4 class (no AMX) 0.7 ms for gate_up at
# 80 and at 1,999 rows, and the padding's 48 rows of a 2,000-token prompt cost its sliced steps
# 0.17 s of 2.65 (its attention 97 ms, the deepest rows) and, uncounted by the budget's weights,
# made the steps that held them overrun: benchmarks/chunked_prefill.py, `--quantize auto`, two
# runs each, padded / not: the streams' largest gap 3.81x and 4.42x / 3.52x and 3.54x their TPOT,
# the long prompt's TTFT 1.90x and 1.98x / 1.74x and 1.77x alone
PAD_UNLESS_NEW_COUNT_MS = 5.0


@dataclass(frozen=True)
class StepLogits:
    """A step's logits: `sampled` (d + K, V) as ModelRunner.forward describes them, and, for each
    prefill (by its index in the step) whose request echoes its prompt's log-probabilities, every
    token's of its chunk (length, V): row j predicts the token after position chunk.start + j."""

    sampled: torch.Tensor
    prompt: dict[int, torch.Tensor] = field(default_factory=dict)
    # in a step with a layer-sliced chunk, the decoding rows' part's seconds, timed where the
    # operators run synchronously (a CPU), else None: what the prefill budget weighs the chunk's
    # part against (PrefillBudget.observe_slice)
    decode_seconds: float | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, max_batch: int, max_context: int, device: torch.device,
                 dtype: torch.dtype, quantize: str = "none", trace_decode: bool = False,
                 dynamic_head_bits: int = 0, onednn_weights: bool = False, compile_decode: bool = False,
                 int4_kernel: str = "torch", verify_tokens: int = 0, onednn_rows: int = 1, amx_rows: int = 0) -> None:
        self.model = model
        self.device = device
        self.cache = KVCache(model.config, max_batch, max_context, dtype, device)
        model.pack_projections()
        model.setup_rope(max_context, device)
        # the layers' weights prepacked for oneDNN when asked (machine/precision.choose_onednn_weights);
        # not the LM head, whose calls of more than a few rows are rare (echoed prompts)
        self.onednn_weights = onednn_weights
        if onednn_weights:
            for packed in model.projections()[:-1]:
                packed.pack_onednn(onednn_rows)  # laid out for calls of that many rows (onednn_layout_rows)
        if quantize != "none":
            quantize_model(model.projections(), quantize, dynamic_head_bits=dynamic_head_bits,
                           int4_kernel=int4_kernel, amx_rows=amx_rows)
        self._decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = partial(model.decode, cache=self.cache)
        if trace_decode:
            try:
                self._decode = TracedDecode(model, self.cache, max_batch)
            except RuntimeError as err:  # the tracer's failures; eager decoding gives the same tokens, slower
                log.warning("decode_trace_failed", error_type=type(err).__name__, error=str(err))
        # a step of decoding rows beside one prompt chunk, traced too (TracedMixed); others run eagerly
        self._mixed: TracedMixed | None = None
        if trace_decode:
            try:
                self._mixed = TracedMixed(model, self.cache)
            except RuntimeError as err:  # the tracer's failures; the eager step gives the same tokens, slower
                log.warning("mixed_trace_failed", error_type=type(err).__name__, error=str(err))
        # a verify step of one row and `verify_tokens` tokens (speculation's last token and draft,
        # padded), traced too; other verify steps run eagerly
        self._verify_traced: TracedVerify | None = None
        if trace_decode and verify_tokens > 1:
            try:
                self._verify_traced = TracedVerify(model, self.cache, verify_tokens)
            except RuntimeError as err:  # the tracer's failures; the eager verify step gives the same tokens
                log.warning("verify_trace_failed", error_type=type(err).__name__, error=str(err))
        # the layer-sliced chunk in flight: its sequence, its (start, length) (its row may move between
        # steps) and its last span's output (T, hidden)
        self._sliced: tuple[Sequence, tuple[int, int], torch.Tensor] | None = None
        # a sliced chunk padded to whole SLICE_BUCKETs, unless warm_sliced_prefill found new row counts cheap
        self.pad_sliced = True
        # what engine_ready says of the compiled step: on, off, or why it failed
        self.compiled_decode = "on" if compile_decode else "off"
        self._compiled: CompiledDecode | None = None
        if compile_decode:
            try:
                # the engine's int4 kernels' copies are no module's tensors, and the attention kernel no
                # module at all, so the setting keys them apart
                setting = {"quantize": quantize, **({"int4_kernel": int4_kernel} if int4_kernel != "torch" else {}),
                           **({"decode_attention": model.decode_attention} if model.decode_attention else {})}
                self._compiled = CompiledDecode(model, self.cache, self._decode, cache_dir(), setting)
                self._decode = self._compiled
            except (RuntimeError, OSError) as err:
                # export's and the C++ compiler's failures (torch raises them as RuntimeError), or
                # the cache directory's: the traced step serves, slower, and engine_ready says so
                log.warning("decode_compile_failed", error_type=type(err).__name__, error=str(err)[:2000])
                self.compiled_decode = f"failed, the traced step serves: {type(err).__name__}"
        if self._compiled is not None and self._verify_traced is not None:
            try:  # the largest verify step compiled too; smaller ones, and where this fails, the traces
                self._compiled.add_verify(verify_tokens)
                self.compiled_decode = f"on, and the verify step of {verify_tokens} tokens"
            except (RuntimeError, OSError) as err:  # as the one-row step's
                log.warning("decode_compile_failed", error_type=type(err).__name__, error=str(err)[:2000])
                self.compiled_decode = f"on, but the verify step failed, its trace serves: {type(err).__name__}"

    def forward(self, plan: StepPlan) -> StepLogits:
        """The logits of `plan`'s step, laid out as its entries' `logits` slices say (step_plan.py):
        each decode row's (fed its last token, or in a speculative plan its last token and its
        draft: 1 + len(draft) rows), then the last prompt token's of each prefill that completes its
        prompt. Prefills whose request has echo_prompt_logprobs also give every token's
        (StepLogits.prompt). The decode rows are KV rows 0..d-1, which is what model.decode reads.
        A layer-sliced chunk runs after the decoding rows, and its completing row comes last."""
        sliced = plan.sliced
        if sliced is None:
            return self._verify(plan.decodes, plan.prefills) if plan.speculative else self._step(plan)
        logits, decode_seconds = None, None
        if plan.decodes:
            started = time.perf_counter()
            logits = self._verify(plan.decodes, ()) if plan.speculative else self._step(StepPlan(plan.decodes, ()))
            decode_seconds = time.perf_counter() - started if self.device.type == "cpu" else None
        last = self._slice(sliced)
        if last is None:
            sampled = logits.sampled if logits is not None else torch.empty(0, 0, device=self.device)
        else:
            sampled = last if logits is None else torch.cat([logits.sampled, last])
        return StepLogits(sampled, decode_seconds=decode_seconds)

    @torch.inference_mode()
    def _slice(self, prefill: Prefill) -> torch.Tensor | None:
        """`prefill`'s chunk through its span (prefill.sublayers), from the span before's output,
        which the runner holds (its rows through the sublayers run so far); the logits (1, V) of its
        last token where it completes its prompt, else None. A part of a sublayer runs its rows as
        a chunk of their own, at their positions."""
        span, chunk = prefill.sublayers, prefill.chunk
        assert span is not None
        padded = self._padded(chunk)
        tokens = self._prompt_tokens([prefill])
        tokens = torch.cat([tokens, tokens[-1:].expand(padded.length - chunk.length)])
        if (span.first, span.first_row) == (0, 0):
            hidden = self.model.embed(tokens)
        else:
            held = self._sliced
            if held is None or held[0] is not prefill.seq or held[1] != (chunk.start, chunk.length):
                raise PlanError(f"layer-sliced prefill of {prefill.seq.request_id}: sublayers from {span.first} "
                                f"row {span.first_row} on, but no output of the layers before is held for it")
            hidden = held[2]
        for sublayers, first, stop in span.pieces(padded.length):
            if (first, stop) == (0, padded.length):
                hidden = self.model.prefill_sublayers(tokens, hidden, padded, sublayers, self.cache)
            else:
                part = padded._replace(start=padded.start + first, length=stop - first)
                hidden[first:stop] = self.model.prefill_sublayers(tokens[first:stop], hidden[first:stop], part,
                                                                  sublayers, self.cache)
        self._sliced = None if span.last else (prefill.seq, (chunk.start, chunk.length), hidden)
        return self.model.chunk_logits(hidden[:chunk.length]) if prefill.completes else None

    def _padded(self, chunk: PromptChunk) -> PromptChunk:
        """`chunk` padded to a multiple of SLICE_BUCKET tokens where the row has the positions (the
        budget sizes every sliced chunk so, but a prompt's last), so that its matmuls' row counts
        are the few warm_sliced_prefill made at start-up; as it is where warm_sliced_prefill found
        a new row count cheap (`pad_sliced`). The padding's keys and values land past the chunk,
        where no token attends, and the prompt's next tokens, or the generated ones, overwrite them."""
        if not self.pad_sliced:
            return chunk
        bucket = -(-chunk.length // SLICE_BUCKET) * SLICE_BUCKET
        return chunk._replace(length=max(chunk.length, min(bucket, self.cache.max_context - chunk.start)))

    def warm_sliced_prefill(self) -> float | None:
        """Run the first layer's projections over each row count a sliced chunk or a part of its
        rows runs at (the multiples of SLICE_BUCKET up to the context, or up to MAX_SLICE_TOKENS
        and the rest of at most MIN_SLICE_TOKENS it may join), so that oneDNN makes its kernels for
        them now and not in a step beside decoding rows: a new count cost 30-45 ms there, against
        20-45 ms for a 2,000-token chunk's layer itself (SmolLM2 in bfloat16, Xeon 207 with AMX).
        Then, on a CPU, time what a count never seen costs the four projections the first time
        beyond the next (`_new_count_ms`); where it is under PAD_UNLESS_NEW_COUNT_MS, a sliced
        chunk runs unpadded (`pad_sliced`): its last rows at their own count, rather than up to
        SLICE_BUCKET - 1 rows more through every sublayer. Returns that time, None off a CPU."""
        layer = self.model.model.layers[0]
        for rows in range(SLICE_BUCKET, min(self.cache.max_context, MAX_SLICE_TOKENS + MIN_SLICE_TOKENS) + 1,
                          SLICE_BUCKET):
            self._projections(layer, rows)
        if self.device.type != "cpu":
            return None
        new_count_ms = self._new_count_ms(layer)
        self.pad_sliced = new_count_ms >= PAD_UNLESS_NEW_COUNT_MS
        return new_count_ms

    def _new_count_ms(self, layer: torch.nn.Module) -> float:
        """The least, over three row counts no call has used, of what the four projections of
        `layer` take at one the first time beyond the second, in ms: the cost of a chunk's last
        rows at a count of their own."""
        excess = []
        for rows in (SLICE_BUCKET + 1, SLICE_BUCKET + 3, SLICE_BUCKET + 5):
            before = time.perf_counter()
            self._projections(layer, rows)
            between = time.perf_counter()
            self._projections(layer, rows)
            after = time.perf_counter()
            excess.append((between - before) - (after - between))  # the first call's time less the second's
        return min(excess) * 1000

    def _projections(self, layer: torch.nn.Module, rows: int) -> None:
        """`layer`'s four projections over `rows` rows of zeros, nothing cached."""
        hidden, width = self.model.config.hidden_size, layer.mlp.size
        x = torch.zeros(1, rows, hidden, dtype=self.cache.k.dtype, device=self.device)
        layer.self_attn.qkv(x)
        layer.self_attn.out(torch.zeros(1, rows, layer.self_attn.heads * layer.self_attn.head_dim,
                                        dtype=x.dtype, device=self.device))
        layer.mlp.gate_up(x)
        layer.mlp.down(torch.zeros(1, rows, width, dtype=x.dtype, device=self.device))

    def _step(self, plan: StepPlan) -> StepLogits:
        """A plain step's logits (no draft, no layer-sliced chunk), as `forward` lays them out."""
        decodes, prefills = plan.decodes, plan.prefills
        tokens = torch.tensor([d.seq.generated[-1] for d in decodes], dtype=torch.long, device=self.device)
        positions = torch.tensor([d.seq.cache_len for d in decodes], dtype=torch.long, device=self.device)
        if not prefills:
            return StepLogits(self._decode(tokens, positions))
        prompt = self._prompt_tokens(prefills)
        traced = self._mixed_traced(tokens, positions, prompt, plan)
        if traced is not None:
            return StepLogits(traced)
        echo = [i for i, p in enumerate(prefills) if p.seq.request.echo_prompt_logprobs]
        logits = self.model.step(tokens, positions, prompt, [p.chunk for p in prefills],
                                 self.cache, logits_of=[i for i, p in enumerate(prefills) if p.completes],
                                 every_token_of=echo)
        return _split(logits, len(decodes), prefills, set(echo))

    def _mixed_traced(self, tokens: torch.Tensor, positions: torch.Tensor, prompt: torch.Tensor,
                      plan: StepPlan) -> torch.Tensor | None:
        """The logits of a step of decoding rows beside one prompt chunk (`prompt` its tokens) in the
        row after theirs, through TracedMixed; None where it does not serve (no trace, another
        layout, an echoed prompt, a regime not traced)."""
        decodes, prefills = plan.decodes, plan.prefills
        if self._mixed is None or not decodes or len(prefills) != 1:
            return None
        prefill = prefills[0]
        if prefill.chunk.row != len(decodes) or prefill.seq.request.echo_prompt_logprobs:
            return None
        return self._mixed(tokens, positions, prompt, prefill.chunk, prefill.completes)

    def _verify(self, decodes: Seq[DecodeRow], prefills: Seq[Prefill]) -> StepLogits:
        """Each decode row as a chunk of its last token and its draft at its next positions, in its
        row (the keys and values of rejected draft tokens are overwritten later: the row's
        cache_len moves past accepted tokens only), then the prefills' chunks."""
        fed = [[d.seq.generated[-1], *d.draft] for d in decodes]
        if len(fed) == 1 and not prefills:
            logits = self._verify_traced_row(fed[0], decodes[0].seq.cache_len)
            if logits is not None:
                return StepLogits(logits)
        chunks = [PromptChunk(d.row, d.seq.cache_len, len(f)) for d, f in zip(decodes, fed, strict=True)]
        tokens = torch.tensor([t for f in fed for t in f], dtype=torch.long, device=self.device)
        none = tokens[:0]
        echo = {i for i, p in enumerate(prefills) if p.seq.request.echo_prompt_logprobs}
        logits = self.model.step(
            none, none, torch.cat([tokens, self._prompt_tokens(prefills)]), [*chunks, *(p.chunk for p in prefills)],
            self.cache, logits_of=[len(chunks) + i for i, p in enumerate(prefills) if p.completes],
            every_token_of=[*range(len(chunks)), *(len(chunks) + i for i in echo)])
        return _split(logits, sum(len(f) for f in fed), prefills, echo)

    def _verify_traced_row(self, fed: list[int], start: int) -> torch.Tensor | None:
        """Row 0's logits (len(fed), V) fed `fed` from position `start`, padded to a trace's size
        (TracedVerify), through the compiled verify library where it serves that size
        (CompiledDecode.verify), else the trace; None where no trace serves: none made, more tokens
        than the largest, or the padding would pass the context."""
        traced = self._verify_traced
        size = None if traced is None else traced.size(len(fed))
        if traced is None or size is None or start + size > self.cache.max_context:
            return None
        padded = fed + fed[-1:] * (size - len(fed))  # its keys and values land past the draft's, as rejected ones do
        tokens = torch.tensor([padded], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + size, device=self.device)[None, :]
        compiled = self._compiled.verify(tokens, positions) if self._compiled is not None else None
        logits = compiled if compiled is not None else traced(tokens, positions)
        return logits[:len(fed)]

    def _prompt_tokens(self, prefills: Seq[Prefill]) -> torch.Tensor:
        return torch.tensor([t for p in prefills for t in p.seq.request.prompt_ids[
            p.chunk.start:p.chunk.start + p.chunk.length]], dtype=torch.long, device=self.device)


def _split(logits: torch.Tensor, decoded: int, prefills: Seq[Prefill], echo: set[int]) -> StepLogits:
    """The model's rows (the `decoded` decoding rows', then per prefill every token's when echoed,
    else the last token's when it completes) as StepLogits: the sampled rows in the plan's layout."""
    if not echo:
        return StepLogits(logits)
    keep, prompt, at = list(range(decoded)), {}, decoded
    for i, p in enumerate(prefills):
        if i in echo:
            prompt[i] = logits[at:at + p.chunk.length]
            at += p.chunk.length
            if p.completes:
                keep.append(at - 1)
        elif p.completes:
            keep.append(at)
            at += 1
    return StepLogits(logits[keep], prompt)
