"""The engine's factory: an `EngineConfig` in, an `Engine` built whole and running out.

Precision, model, runner, prefill budget, scheduler, decode loop and speculator are assembled
here, once, in that order; the Engine receives them made and starts its decode loop thread. A load
that fails raises (the server logs `engine_start_failed` and exits 2): no half-built engine exists.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import structlog
import torch

from engine_service.config import EngineConfig
from engine_service.faults import FaultInjector
from engine_service.generation.speculative import SpeculativeConfig
from engine_service.machine.cpu import CpuInfo, detect
from engine_service.machine.precision import (
    AMX_INT4_ON,
    DECODE_ATTENTION_OFF,
    LAYER_OPS_OFF,
    PROMPT_ATTENTION_OFF,
    TORCH_INT4,
    Precision,
    choose_amx_int4,
    choose_compiled_decode,
    choose_decode_attention,
    choose_dtype,
    choose_dynamic_head,
    choose_layer_ops,
    choose_onednn_weights,
    choose_prompt_attention,
    choose_q4_kernel,
    choose_quantize,
    find_cpp_compiler,
    keep_prompt_attention,
    keep_q4_kernel,
    onednn_layout_rows,
)
from engine_service.model import decode_attention, int4_race, layer_ops, prompt_attention, q4_matmul
from engine_service.model.attention_cost import measured_parity
from engine_service.model.compiled_decode import cache_dir
from engine_service.model.config import ModelConfig
from engine_service.model.llama import LlamaForCausalLM
from engine_service.model.loader import LoadedModel, load_model
from engine_service.model.quantize import AMX_INT4_MAX_ROWS, INT16_KERNEL_INT4_MAX_ROWS
from engine_service.requests import Limits
from engine_service.runtime.engine import Engine, EngineInfo, FatalCallback
from engine_service.runtime.loop import DecodeLoop, Deliver, set_threads
from engine_service.runtime.model_runner import ModelRunner
from engine_service.runtime.speculator import Speculator
from engine_service.scheduling.prefill_budget import PrefillBudget, attention_parity, attention_share
from engine_service.scheduling.prefix_cache import PrefixCache
from engine_service.scheduling.scheduler import Scheduler

log = structlog.get_logger()

K = TypeVar("K")  # one of the engine's kernels' operators (_probed)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


async def build_engine(config: EngineConfig) -> Engine:
    """Load the model off the event loop, assemble the engine around it and start its decode loop
    thread; logs `engine_ready`. Raises whatever the load raises (a missing model, a bad checkpoint)."""
    cfg = config
    set_threads(cfg.threads)
    cpu = detect()
    device = torch.device(cfg.device)
    event_loop = asyncio.get_running_loop()
    # Loaded in a thread that ends afterwards, not in asyncio's executor, whose threads live on.
    # libgomp gives every thread that runs a parallel torch op an OpenMP team of its own, and
    # while it manages more threads than there are cores it all but stops spin-waiting: the
    # decode loop's OpenMP workers then sleep between the hundreds of small parallel ops of a
    # step and are woken for each. Measured on SmolLM2 in bfloat16, batch 1, 2 cores: 1.4 cores
    # busy and 57-67 ms a step with a second team alive, 2.0 cores and 44-54 ms without.
    # So the decode loop's thread must be the only thread that runs torch for long.
    loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-load")
    try:
        built = await event_loop.run_in_executor(loader, build_runner, cfg, cpu)
    finally:
        loader.shutdown(wait=False)  # its thread, and with it its OpenMP team, ends once idle
    loaded, runner, precision, compiled_reason, parity = (built.loaded, built.runner, built.precision,
                                                          built.compiled_reason, built.parity)
    limits = Limits(loaded.config.vocab_size, cfg.max_context, cfg.max_new_tokens_limit)
    info = _engine_info(cfg, loaded, precision, device, cpu)
    # long prompts beside decoding rows layer-sliced with the adaptive budget (prefill_budget.py)
    budget = PrefillBudget(cfg.max_prefill_tokens, cfg.max_context, parity, sublayers=2 * loaded.config.num_hidden_layers,
                           attention_share=attention_share(loaded.config))
    scheduler = Scheduler(cfg.max_batch, cfg.max_context, cfg.queue_capacity, cfg.queue_retry_seconds,
                          prefill_token_budget=budget.tokens(1, 0), slicer=budget)

    def decode_loop(deliver: Deliver, on_fatal: FatalCallback) -> DecodeLoop:
        return DecodeLoop(runner, scheduler, FaultInjector(cfg.faults), _end_tokens(loaded), deliver, on_fatal,
                          built.prefix_cache, budget,
                          Speculator(SpeculativeConfig(num_tokens=cfg.speculative_tokens))
                          if cfg.speculative == "ngram" else None)

    engine = Engine(cfg, loaded, info, limits, decode_loop)
    log.info("engine_ready", model=loaded.name, device=str(device), dtype=precision.dtype,
             quantize=precision.quantize, precision_reason=precision.reason, cpu=cpu.describe(),
             weight_format=loaded.weight_format, trace_decode=cfg.trace_decode, onednn_weights=runner.onednn_weights,
             compiled_decode=runner.compiled_decode, compiled_decode_reason=compiled_reason,
             decode_attention=built.attention_reason, prompt_attention=built.prompt_attention_reason,
             layer_ops=built.layer_ops_reason,
             speculative=cfg.speculative,
             kv_cache_bytes=runner.cache.bytes_per_token() * cfg.max_batch * cfg.max_context,
             max_prefill_tokens=cfg.max_prefill_tokens or "auto", attention_parity=round(parity),
             prefix_cache_tokens=cfg.prefix_cache_tokens,
             prefix_cache_bytes=runner.cache.bytes_per_token() * cfg.prefix_cache_tokens,
             tokenizer=loaded.tokenizer.kind)
    return engine


@dataclass(frozen=True)
class BuiltRunner:
    """What `build_runner` made: the model loaded, its runner, the precision chosen and why, and
    what engine_ready says of the compiled one-row step, of decode and prompt attention and of the
    layer's operators."""

    loaded: LoadedModel
    runner: ModelRunner
    precision: Precision
    compiled_reason: str
    parity: float  # the prefill budget's attention parity: `chunk_parity`'s
    attention_reason: str  # who computes the decoding rows' attention, and why: engine_ready's decode_attention
    # who computes the norms, rotary embeddings and cache writes outside the compiled step, and why:
    # engine_ready's layer_ops
    layer_ops_reason: str
    prefix_cache: PrefixCache  # reserved for the runner's cache (PrefixCache.reserve)
    prompt_attention_reason: str  # who computes prompt chunks' attention, and why: engine_ready's prompt_attention


def chunk_parity(model: LlamaForCausalLM, config: EngineConfig) -> float:
    """The prefill budget's attention parity (the cached positions at which a prompt token's
    attention costs as much as its matmuls): on a CPU, measured at start-up
    (model/attention_cost.py), held within 1/8 and 2x of the one the model's FLOPs give (one
    measurement of milliseconds on a machine others share: a stalled call is not a property of it);
    elsewhere, by FLOPs (timing there would need the device's synchronisation)."""
    flops = attention_parity(model.config)
    if not config.device.startswith("cpu"):
        return flops
    return min(2 * flops, max(flops / 8, measured_parity(model, config.max_context)))


def build_runner(cfg: EngineConfig, cpu: CpuInfo) -> BuiltRunner:
    """The model loaded and its runner built as the engine serves it on `cpu`: the precision, the
    int4 kernels (built, raced, probed), the prepacked weights, the traces and the compiled step.
    Blocking (seconds; a first compile, minutes): the engine runs it in a loader thread, and
    benchmarks/step_ab.py calls it to time two checkouts' steps as each engine would run them."""
    device = torch.device(cfg.device)
    dtype_name, dtype_reason = choose_dtype(cfg.dtype, cfg.device, cpu)
    dtype = DTYPES[dtype_name]
    loaded = load_model(cfg.model, device, dtype)
    quantize, quantize_reason = choose_quantize(cfg.quantize, cfg.device, loaded.weight_format)
    dynamic_head_bits, head_reason = choose_dynamic_head(quantize, cfg.device, cpu)
    int4_kernel, q4_reason = _load_q4_kernel(cfg.int4_kernel, quantize, dtype_name, cfg.device, cpu, loaded.config)
    amx_rows, amx_reason = _load_amx_kernel(int4_kernel, cpu)
    reasons = [dtype_reason, quantize_reason, *(r for r in (head_reason, q4_reason, amx_reason) if r)]
    precision = Precision(dtype_name, quantize, "; ".join(reasons))
    compiled, compiled_reason = choose_compiled_decode(cfg.compile_decode, cfg.device, quantize, cfg.trace_decode,
                                                       find_cpp_compiler())
    attention, attention_reason = _load_decode_attention(dtype_name, cfg.device, cpu, loaded.config)
    loaded.model.use_decode_attention(attention)  # before the runner traces and compiles its steps
    prompt_kernel, prompt_attention_reason = _load_prompt_attention(dtype_name, cfg.device, cpu, loaded.config,
                                                                    cfg.max_context)
    loaded.model.use_prompt_attention(prompt_kernel)  # likewise
    ops, layer_ops_reason = _load_layer_ops(dtype_name, cfg.device, cpu)
    loaded.model.use_layer_ops(ops)  # likewise
    runner = ModelRunner(
        loaded.model, cfg.max_batch, cfg.max_context, device, dtype, quantize, cfg.trace_decode, dynamic_head_bits,
        choose_onednn_weights(dtype_name, cfg.device), compiled, int4_kernel,
        1 + cfg.speculative_tokens if cfg.speculative == "ngram" else 0, onednn_layout_rows(cpu), amx_rows)
    if cfg.max_prefill_tokens is None:  # the adaptive budget, which layer-slices long prompts (prefill_budget.py)
        started = time.monotonic()
        new_count_ms = runner.warm_sliced_prefill()
        log.info("sliced_prefill_warmed", seconds=round(time.monotonic() - started, 2), padded=runner.pad_sliced,
                 new_row_count_ms=None if new_count_ms is None else round(new_count_ms, 2))
    prefix_cache = PrefixCache(cfg.prefix_cache_tokens)
    started = time.monotonic()
    prefix_cache.reserve(runner.cache)  # here, in the loader's thread: its pages written before any step
    log.info("prefix_cache_reserved", tokens=cfg.prefix_cache_tokens, seconds=round(time.monotonic() - started, 2))
    return BuiltRunner(loaded, runner, precision, compiled_reason, chunk_parity(runner.model, cfg), attention_reason,
                       layer_ops_reason, prefix_cache, prompt_attention_reason)


def _load_q4_kernel(requested: str, quantize: str, dtype: str, device: str, cpu: CpuInfo,
                    config: ModelConfig) -> tuple[str, str]:
    """(who multiplies the int4 layers, reason): choose_q4_kernel's answer, and where it names one
    of the engine's kernels, its library built or found in the compile cache and loaded
    (model/q4_matmul.py), then with `--int4-kernel auto` raced against torch's on `config`'s
    largest layer (model/int4_race.py), the faster kept."""
    compiler = find_cpp_compiler()
    kernel, reason = choose_q4_kernel(requested, quantize, dtype, device, cpu, compiler)
    if kernel == "torch" or compiler is None:
        return "torch", reason
    try:
        q4_matmul.load(compiler, cache_dir(), q4_matmul.KERNELS[kernel])
    except (RuntimeError, OSError) as err:
        # the compiler's failure, torch's refusal to load the library or the cache directory's:
        # torch's int4 kernel serves, slower, and engine_ready's precision_reason says why
        log.warning("q4_kernel_failed", kernel=kernel, error_type=type(err).__name__, error=str(err)[:2000])
        return "torch", f"int4 layers in {TORCH_INT4[kernel]}: the {kernel} one failed to build ({type(err).__name__})"
    if requested != "auto":
        return kernel, reason
    result = int4_race.race(kernel, config, DTYPES[dtype])
    kept, reason = keep_q4_kernel(kernel, result.ours_us, result.torch_us, result.rows)
    log.info("q4_kernel_raced", kernel=kernel, rows=result.rows, kept=kept == kernel,
             ours_us=[round(t, 1) for t in result.ours_us], torch_us=[round(t, 1) for t in result.torch_us])
    return kept, reason


AMX_INT4_OFF = f"calls of more than {INT16_KERNEL_INT4_MAX_ROWS} rows on the bfloat16 weights"  # _load_amx_kernel's failures


def _load_amx_kernel(int4_kernel: str, cpu: CpuInfo) -> tuple[int, str]:
    """(rows up to which the int16 copies serve calls through the AMX int4 kernel, 0 for none;
    reason, "" where the question does not arise): where choose_amx_int4 allows it, the kernel's
    library built or found in the compile cache, loaded, and run once against the float32
    arithmetic (Linux hands a process the tiles only when it asks: model/q4_amx.cpp)."""
    compiler = find_cpp_compiler()
    if compiler is None or not choose_amx_int4(int4_kernel, cpu):
        return 0, ""
    try:
        q4_matmul.load(compiler, cache_dir(), q4_matmul.KERNELS["amx"])
        error = q4_matmul.probe_error(q4_matmul.KERNELS["amx"])
    except (RuntimeError, OSError) as err:
        # the compiler's failure, torch's refusal to load the library, the cache directory's, or the
        # kernel's own check (the tiles refused): the bfloat16 weights serve those calls, as before
        log.warning("amx_kernel_failed", error_type=type(err).__name__, error=str(err)[:2000])
        return 0, f"{AMX_INT4_OFF}: the AMX int4 kernel failed ({type(err).__name__})"
    if error > q4_matmul.PROBE_TOLERANCE:
        log.warning("amx_kernel_failed", error_type="WrongResult", error=f"largest relative error {error:.3g}")
        return 0, f"{AMX_INT4_OFF}: the AMX int4 kernel's product was {error:.3g} off"
    return AMX_INT4_MAX_ROWS, AMX_INT4_ON.format(rows=AMX_INT4_MAX_ROWS)


def _load_decode_attention(dtype: str, device: str, cpu: CpuInfo,
                           config: ModelConfig) -> tuple[decode_attention.DecodeAttention | None, str]:
    """(the decoding rows' attention kernel, None for torch's; the reason, engine_ready's
    decode_attention): where choose_decode_attention takes it, its library built or found in the
    compile cache, loaded, and run once against float32 attention (model/decode_attention.py)."""
    compiler = find_cpp_compiler()
    chosen, reason = choose_decode_attention(dtype, device, cpu, compiler, config.dim_per_head,
                                             config.num_attention_heads // config.num_key_value_heads)
    if chosen is None or compiler is None:
        return None, reason
    kernel, failure = _probed(lambda: decode_attention.load(compiler, cache_dir(), chosen), decode_attention.probe_error,
                              decode_attention.PROBE_TOLERANCE, "decode_attention_failed")
    return (kernel, reason) if kernel is not None else (None, f"{DECODE_ATTENTION_OFF}: {failure}")


def _load_prompt_attention(dtype: str, device: str, cpu: CpuInfo, config: ModelConfig,
                           max_context: int) -> tuple[prompt_attention.PromptAttention | None, str]:
    """(prompt chunks' attention kernel, None for torch's; the reason, engine_ready's
    prompt_attention): where choose_prompt_attention takes it, its library built or found in the
    compile cache, loaded, run once against float32 attention, then raced against torch's on the
    model's heads and kept where it wins (model/prompt_attention.py, precision.keep_prompt_attention)."""
    compiler = find_cpp_compiler()
    chosen, reason = choose_prompt_attention(dtype, device, cpu, compiler, config.dim_per_head)
    if not chosen or compiler is None:
        return None, reason
    kernel, failure = _probed(lambda: prompt_attention.load(compiler, cache_dir()), prompt_attention.probe_error,
                              prompt_attention.PROBE_TOLERANCE, "prompt_attention_failed")
    if kernel is None:
        return None, f"{PROMPT_ATTENTION_OFF}: {failure}"
    ours, torchs = prompt_attention.race(kernel, config, max_context)
    tokens, chunk, depth = prompt_attention.race_shapes(max_context)
    kept, reason = keep_prompt_attention(ours, torchs, tokens, chunk, depth)
    log.info("prompt_attention_raced", kept=kept, ours_us=[round(t, 1) for t in ours],
             torch_us=[round(t, 1) for t in torchs])
    return (kernel if kept else None), reason


def _load_layer_ops(dtype: str, device: str, cpu: CpuInfo) -> tuple[layer_ops.LayerOps | None, str]:
    """(a layer's small operators outside the compiled step, None for torch's; the reason,
    engine_ready's layer_ops): where choose_layer_ops takes them, their library built or found in
    the compile cache, loaded, and a norm run once against torch's (model/layer_ops.py)."""
    compiler = find_cpp_compiler()
    chosen, reason = choose_layer_ops(dtype, device, cpu, compiler)
    if not chosen or compiler is None:
        return None, reason
    ops, failure = _probed(lambda: layer_ops.load(compiler, cache_dir()), layer_ops.probe_error,
                           layer_ops.PROBE_TOLERANCE, "layer_ops_failed")
    return (ops, reason) if ops is not None else (None, f"{LAYER_OPS_OFF}: {failure}")


def _probed(load: Callable[[], K], probe: Callable[[K], float], tolerance: float, event: str) -> tuple[K | None, str]:
    """(one of the engine's own kernels, loaded by `load` and checked once by `probe` within
    `tolerance`; or None and why it does not serve, also logged as `event`)."""
    try:
        kernel = load()
        error = probe(kernel)
    except (RuntimeError, OSError) as err:
        # the compiler's failure, torch's refusal to load the library, the cache directory's, or the
        # kernel's own checks: torch's operators serve, as before, and engine_ready says why
        log.warning(event, error_type=type(err).__name__, error=str(err)[:2000])
        return None, f"the engine's kernel failed ({type(err).__name__})"
    if error > tolerance:
        log.warning(event, error_type="WrongResult", error=f"largest relative error {error:.3g}")
        return None, f"the engine's kernel was {error:.3g} off"
    return kernel, ""


def _engine_info(cfg: EngineConfig, loaded: LoadedModel, precision: Precision, device: torch.device,
                 cpu: CpuInfo) -> EngineInfo:
    """What GetServerInfo tells a client about this engine."""
    return EngineInfo(
        model=loaded.name, max_context_tokens=cfg.max_context, max_new_tokens_limit=cfg.max_new_tokens_limit,
        max_batch_size=cfg.max_batch, queue_capacity=cfg.queue_capacity, vocab_size=loaded.config.vocab_size,
        eos_token_id=loaded.config.eos_token_id if loaded.config.eos_token_id is not None
        else loaded.tokenizer.eos_token_id, bos_token_id=loaded.tokenizer.bos_token_id,
        device=str(device), dtype=precision.dtype, tokenizer=loaded.tokenizer.kind,
        has_chat_template=loaded.chat_template is not None, quantization=precision.quantize,
        cpu_capability=cpu.describe() if device.type == "cpu" else str(device), precision_reason=precision.reason,
    )


def _end_tokens(loaded: LoadedModel) -> frozenset[int]:
    """EOS ids that end generation: the model's own (all of them), else the tokenizer's."""
    ids = set(loaded.config.end_token_ids)
    if not ids and loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return frozenset(ids)
