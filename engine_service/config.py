"""Frozen configuration, one dataclass per concern, validated once when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine_service.faults import FaultPlan
from engine_service.scheduling.prefix_cache import BLOCK_TOKENS

# Prompt tokens prefilled in a step that also decodes: by default (None) adapted to the step times
# the decode loop measures (engine_service/scheduling/prefill_budget.py), or a fixed count (--max-prefill-tokens N).
# History of the fixed default, 96: on SmolLM2 bfloat16 with 2 cores, while 8 streams decode (33-35
# ms a step) and a 2,000-token prompt arrives (benchmarks/chunked_prefill.py, one run): at 96 the
# streams' largest gap was 3.7x their TPOT and the prompt's TTFT 1.50x its TTFT alone on a Xeon
# with AMX, but 10.4x on an EPYC with AVX2 in float32: a token count does not travel.
# 8,192 tokens of keys and values: 180 MiB for SmolLM2 in bfloat16 (22.5 KiB a token), 360 MiB in
# float32; an eighth of the KV cache at the default batch and context, and room for eight
# 1,000-token system prompts.
DEFAULT_PREFIX_CACHE_TOKENS = 8192


@dataclass(frozen=True)
class EngineConfig:
    """The model, its placement and the scheduler's limits."""

    model: str = "smollm2"  # the packaged SmolLM2-135M-Instruct GGUF (engine_service.model.presets)
    device: str = "cpu"
    dtype: str = "auto"  # auto: chosen from the CPU (engine_service/machine/precision.py), or float32, bfloat16, float16
    max_batch: int = 32
    max_context: int = 2048
    max_new_tokens_limit: int = 4096
    queue_capacity: int = 256
    queue_retry_seconds: float = 0.5
    max_prefill_tokens: int | None = None  # None: adapted to the measured step times (prefill_budget.py)
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS  # 0: off (engine_service/scheduling/prefix_cache.py)
    stream_interval: int = 1
    stall_seconds: float = 30.0
    faults: FaultPlan = field(default_factory=FaultPlan)
    threads: int = 0
    quantize: str = "auto"  # auto: the file's own (precision.py), or none, int8, int4 (model/quantize.py)
    speculative: str = "none"  # none, or ngram: prompt-lookup speculative decoding (engine_service/runtime/speculator.py)
    speculative_tokens: int = 6  # draft tokens per step and row with --speculative ngram
    trace_decode: bool = True  # the decode step through TorchScript traces (engine_service/model/traced_decode.py)
    compile_decode: str = "auto"  # auto: one-row steps through AOTInductor where precision.py allows it, or off
    int4_kernel: str = "auto"  # auto: the int4 layers in model/q4_matmul.py's kernels where precision.py allows it
    # and they win the start-up race (model/int4_race.py); engine: wherever allowed, no race; torch

    def __post_init__(self) -> None:
        _positive("max_batch", self.max_batch)
        _positive("max_context", self.max_context)
        _positive("max_new_tokens_limit", self.max_new_tokens_limit)
        _positive("queue_capacity", self.queue_capacity)
        if self.max_prefill_tokens is not None:
            _positive("max_prefill_tokens", self.max_prefill_tokens)
        _positive("stream_interval", self.stream_interval)
        if not isinstance(self.prefix_cache_tokens, int) or self.prefix_cache_tokens < 0 \
                or self.prefix_cache_tokens % BLOCK_TOKENS:
            raise ValueError(f"prefix_cache_tokens must be 0 (off) or a multiple of the block size {BLOCK_TOKENS}, "
                             f"got {self.prefix_cache_tokens!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.queue_retry_seconds <= 0:
            raise ValueError(f"queue_retry_seconds must be > 0, got {self.queue_retry_seconds}")
        if self.stall_seconds <= 0:
            raise ValueError(f"stall_seconds must be > 0, got {self.stall_seconds}")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {self.quantize!r}")
        if self.quantize in ("int8", "int4") and self.dtype == "float16":
            # the weight-only kernels take bfloat16 activations (float32 ones are cast to it)
            raise ValueError(f"quantize {self.quantize} needs dtype bfloat16, float32 or auto, got 'float16'")
        if self.quantize in ("int8", "int4") and self.device != "cpu":
            raise ValueError(f"quantize {self.quantize} runs on the CPU only (torch's weight-only CPU kernels), "
                             f"got device {self.device!r}")
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}")
        _positive("speculative_tokens", self.speculative_tokens)
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.compile_decode not in COMPILE_DECODE_CHOICES:
            raise ValueError(f"compile_decode must be one of {', '.join(COMPILE_DECODE_CHOICES)}, "
                             f"got {self.compile_decode!r}")
        if self.int4_kernel not in INT4_KERNEL_CHOICES:
            raise ValueError(f"int4_kernel must be one of {', '.join(INT4_KERNEL_CHOICES)}, got {self.int4_kernel!r}")


@dataclass(frozen=True)
class ServerConfig:
    """Where and how the gRPC server (and the HTTP front beside it) listens, and how it shuts down."""

    host: str = "127.0.0.1"
    port: int = 50051
    grace_seconds: float = 30.0
    max_receive_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 256
    metrics_port: int | None = None
    http_port: int | None = None  # the OpenAI-compatible HTTP front (transport/http_front.py): off unless set
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    auth_token: str | None = field(default=None, repr=False)
    log_text: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be 0..65535, got {self.http_port}")
        if self.grace_seconds < 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        _positive("max_receive_bytes", self.max_receive_bytes)
        _positive("max_concurrent_streams", self.max_concurrent_streams)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")


DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZE_METHODS = ("none", "int8", "int4")
QUANTIZE_CHOICES = ("auto", *QUANTIZE_METHODS)
SPECULATIVE_METHODS = ("none", "ngram")
COMPILE_DECODE_CHOICES = ("auto", "off")
INT4_KERNEL_CHOICES = ("auto", "engine", "int16", "torch")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
