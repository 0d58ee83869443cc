"""The engine's command line: flags -> frozen configs -> serve (entry: engine_service.__main__)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from engine_service.config import (
    COMPILE_DECODE_CHOICES,
    DEFAULT_PREFIX_CACHE_TOKENS,
    DTYPE_CHOICES,
    INT4_KERNEL_CHOICES,
    QUANTIZE_CHOICES,
    SPECULATIVE_METHODS,
    EngineConfig,
    ServerConfig,
)
from engine_service.faults import FaultPlan
from engine_service.model.presets import DEFAULT_MODEL, PACKAGED, PRESETS
from engine_service.scheduling.prefix_cache import BLOCK_TOKENS
from shared.logging import configure_logging
from shared.tracing import configure_tracing, shutdown_tracing

TOKEN_ENV = "ENGINE_AUTH_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine-serve", description="Serve an LLM decode engine over gRPC (engine.v1), and OpenAI-compatible HTTP with --http-port.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"a packaged real model ({', '.join(PACKAGED)}: SmolLM2-135M-Instruct, GGUF Q4_1), a preset "
                        f"with random weights from a fixed seed ({', '.join(PRESETS)}), a GGUF file (PATH.gguf: llama "
                        "or qwen2; F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) or a Hugging Face checkpoint "
                        "directory (config.json, *.safetensors, tokenizer.json)")
    m.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    m.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="weights, activations and KV cache dtype; auto: bfloat16 on CUDA and on CPUs with native "
                        "bfloat16 (avx512_bf16, AMX), float32 on others (bfloat16 is emulated there); see README")
    m.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    m.add_argument("--quantize", default="auto", choices=QUANTIZE_CHOICES,
                   help="weight-only copies of the projections that serve decode steps of few rows (faster "
                        "small-batch decode on a CPU): int8 per channel, +50%% of a bfloat16 model's weights; int4 in "
                        "groups of 32 (Q4_1's layout: near-lossless on a Q4_1 model such as smollm2), +25%%; auto: a "
                        "GGUF's own (Q4_0/Q4_1/Q4_K -> int4, Q8_0/Q5_K/Q6_K -> int8), none for other files and on "
                        "CUDA; none: the weights dequantized into --dtype only")
    m.add_argument("--speculative", default="none", choices=SPECULATIVE_METHODS,
                   help="ngram: prompt-lookup speculative decoding (vLLM's ngram, llama.cpp's lookup): draft the "
                        "tokens that followed the latest earlier occurrence of the text's last 2-4 tokens, verify them "
                        "in one forward, keep those the model agrees with (greedy: the tokens of decoding without it, up to "
                        "the rounding that batching changes too); "
                        "only while at most 4 rows decode. Pays on input-grounded tasks (repeating, editing, quoting)")
    m.add_argument("--speculative-tokens", type=int, default=6, help="draft tokens per step with --speculative ngram")
    m.add_argument("--trace-decode", action=argparse.BooleanOptionalAction, default=True,
                   help="run the decode step as TorchScript traces made at start-up (the same operators without "
                        "Python's dispatch of each; a second or two to trace)")
    m.add_argument("--compile-decode", default="auto", choices=COMPILE_DECODE_CHOICES,
                   help="auto: on a CPU, for a quantized model, where a C++ compiler (g++ or $CXX) is found, the "
                        "one-row decode step runs as a library AOTInductor compiles at the first start (a minute or "
                        "two on 2 cores, then kept in $ENGINE_COMPILE_CACHE, else ~/.cache/engine-bench/compiled) "
                        "and fuses the step's small operators in; its logits round differently from the trace's. "
                        "off: the traced step alone. engine_ready says which ran and why")
    m.add_argument("--int4-kernel", default="auto", choices=INT4_KERNEL_CHOICES,
                   help="auto: the int4 layers multiply in one of the engine's int4 kernels where a C++ compiler is "
                        "found (built at the first start, about 10 s, then kept beside the compiled step's library) "
                        "and it beats torch's in a start-up race on the model's largest layer (35-75 ms): a "
                        "float32 model's in the float32 one where the CPU has AVX2 and FMA, a bfloat16 model's in the "
                        "int8 one (its rows at 8 bits a group of 32, as llama.cpp multiplies Q4_1; 8-bit integer dot "
                        "products) where it has AVX-512 VNNI and BF16; engine: the same kernels without the race; "
                        "int16: a bfloat16 model's in the int16 one (rows at 16 bits: closer to the bfloat16 "
                        "model, slower), without the race; torch: torch's int4 kernel, which computes in bfloat16. "
                        "engine_ready's precision_reason says which, and the race's times")
    s = p.add_argument_group("scheduler and limits")
    s.add_argument("--max-batch", type=int, default=32, help="running sequences decoded together")
    s.add_argument("--max-context", type=int, default=2048,
                   help="tokens per sequence (prompt + max_new_tokens); the KV cache holds max-batch x max-context")
    s.add_argument("--max-new-tokens", type=int, default=4096, help="largest max_new_tokens a request may ask")
    s.add_argument("--queue-capacity", type=int, default=256,
                   help="waiting requests beyond the running batch; more get RESOURCE_EXHAUSTED/QUEUE_FULL")
    s.add_argument("--max-prefill-tokens", type=_prefill_tokens, default="auto",
                   help="prompt tokens prefilled in one step, in chunks, beside the decoding rows: a smaller "
                        "budget keeps running streams' inter-token gaps short while a long prompt prefills, a "
                        "larger one prefills faster; auto: sized to keep such a step near 3.5 decode-only steps, "
                        "from the decode-step and idle-prefill times measured as the engine runs, and a prompt "
                        "with more than 512 tokens to go layer-sliced: large chunks, each through a span of the "
                        "layers a step, near 3 decode steps (see README)")
    s.add_argument("--prefix-cache-tokens", type=int, default=DEFAULT_PREFIX_CACHE_TOKENS,
                   help=f"tokens of computed prompt keys and values kept for reuse by prompts with the same "
                        f"prefix, in blocks of {BLOCK_TOKENS}; 0 turns the prefix cache off")
    s.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per stream message after the first (as vLLM's --stream-interval): fewer, larger "
                        "messages cost less CPU at high throughput; the first token and the end are sent at once")
    s.add_argument("--queue-retry-seconds", type=float, default=0.5, help="RetryInfo delay sent with QUEUE_FULL")
    s.add_argument("--stall-seconds", type=float, default=30.0,
                   help="a stream whose reader takes no tokens for this long is cancelled and its KV freed")
    s.add_argument("--fault", action="append", default=[], metavar="SPEC",
                   help="inject faults (testing only): sequence-error:step=N, sequence-error:rate=P[,seed=S], "
                        "crash:step=N")
    n = p.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    n.add_argument("--port", type=int, default=50051, help="port to bind (0: any free port, logged)")
    n.add_argument("--http-port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                        "/health, /tokenize, /detokenize) on this port, on --host, with the same engine, auth and TLS "
                        "(off; 0: any free port, logged)")
    n.add_argument("--grace-seconds", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, how long streams in flight may take to finish")
    n.add_argument("--max-receive-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request message; larger ones get gRPC's RESOURCE_EXHAUSTED (HTTP: 413)")
    n.add_argument("--max-concurrent-streams", type=int, default=256, help="concurrent streams per connection")
    n.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics at http://HOST:PORT/metrics, on --host (off; 0: any free port, logged)")
    n.add_argument("--log-level", default=os.environ.get("ENGINE_LOG_LEVEL"),
                   help="log level (default: ENGINE_LOG_LEVEL, else LOG_LEVEL, else info)")
    n.add_argument("--log-text", action="store_true", help="log prompt and output text (debug only)")
    t = p.add_argument_group("security")
    t.add_argument("--tls-cert", type=Path, help="PEM server certificate (enables TLS)")
    t.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    t.add_argument("--tls-client-ca", type=Path, help="PEM CA bundle; client certificates are then required (mTLS)")
    t.add_argument("--auth-token-file", type=Path,
                   help=f"file holding the bearer token EngineService requires (or set {TOKEN_ENV})")
    return p


def _prefill_tokens(text: str) -> int | str:
    """--max-prefill-tokens: "auto" or a positive integer."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be auto or a positive integer, got {value}")
    return value


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """Build the frozen configs; raises ValueError naming the flag and the value."""
    token = os.environ.get(TOKEN_ENV) or None
    if args.auth_token_file is not None:
        token = args.auth_token_file.read_text().strip()
        if not token:
            raise ValueError(f"--auth-token-file {args.auth_token_file} is empty")
    engine = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_batch=args.max_batch,
        max_context=args.max_context, max_new_tokens_limit=args.max_new_tokens, queue_capacity=args.queue_capacity,
        queue_retry_seconds=args.queue_retry_seconds, max_prefill_tokens=None if args.max_prefill_tokens == "auto" else args.max_prefill_tokens,
        prefix_cache_tokens=args.prefix_cache_tokens,
        stream_interval=args.stream_interval,
        stall_seconds=args.stall_seconds,
        faults=FaultPlan.parse(args.fault), threads=args.threads, quantize=args.quantize,
        trace_decode=args.trace_decode, compile_decode=args.compile_decode, int4_kernel=args.int4_kernel, speculative=args.speculative, speculative_tokens=args.speculative_tokens,
    )
    server = ServerConfig(
        host=args.host, port=args.port, grace_seconds=args.grace_seconds, max_receive_bytes=args.max_receive_bytes,
        max_concurrent_streams=args.max_concurrent_streams, metrics_port=args.metrics_port, http_port=args.http_port, tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_client_ca=args.tls_client_ca, auth_token=token, log_text=args.log_text,
    )
    return engine, server


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        engine_cfg, server_cfg = configs_from_args(args)
        configure_tracing("engine")  # off unless an OTEL_* variable asks for it
    except (ValueError, OSError) as err:
        parser.error(str(err))  # exits 2
    from engine_service.transport.server import serve  # imports torch: after the flags are known good

    try:
        code = asyncio.run(serve(engine_cfg, server_cfg))
    finally:
        shutdown_tracing()  # exports the spans still buffered
    sys.exit(code)
