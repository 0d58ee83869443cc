"""The one-row decode step compiled ahead of time by AOTInductor (`--compile-decode auto`, the
default where machine/precision.choose_compiled_decode allows it), and with `--speculative ngram`
one row's largest verify step (`CompiledDecode.add_verify`), a second library of the same layers.

A traced step (traced_decode.py) still runs SmolLM2's 1,500 small operators one by one, each with
its dispatch; at one stream they are about half the step. AOTInductor compiles the layers of a
one-row step (embedding to the final norm, the int4 or int8 copies' kernels, the KV writes) into one
C++ library that fuses the elementwise operators between the matmuls. The LM head stays an eager
call after it (fbgemm's packed int8 head is a ScriptObject that torch.export cannot take), and any
other row count goes to the traced step. Measured in one process, alternating, one row at 101
positions of a 512-position cache (SmolLM2 Q4_1 served in bfloat16 with int4 copies, Xeon of family
6 model 167 with AMX, 2 cores; benchmarks/aoti_step.py): 14.8 ms against the trace's 20.2 (0.73x).

What the library holds: its own copy of the layers' constants (the quantized copies, norms,
embedding and rotary tables: SmolLM2's library is 127 MB on disk), so it is keyed on a digest of the model's
tensors (`library_key`). What it is given: row 0 of the runner's KV cache, one (1, KV, positions, D)
view a layer for keys and one for values, which it writes in place with `index_copy_` along the
positions (a write into a view of the whole cache is functionalized into a copy of all of it: a
step took 1.2 s; a Python custom op declaring the mutation, the first way out, is a call from the
library back into Python at each of the step's 60 writes). Row 0 alone, so one library serves
every --max-batch. Compiling takes a minute or two on 2 cores, so the library is kept in a cache
directory (`cache_dir`) and later starts load it in seconds; a library no engine has loaded for
30 days is removed when another is compiled (compile_cache.py). Its logits are not bit-identical to the
trace's (fused kernels round in another order); `--compile-decode off` is the trace alone.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

from engine_service.model import compile_cache
from engine_service.model.kv_cache import KVCache, decode_mask, rows_mask
from engine_service.model.llama import LlamaForCausalLM

log = structlog.get_logger()

Decode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# the code a library is compiled from: a change to any of these makes another library (q4_matmul.py
# lays out the int4 kernels' copies, which the library holds as constants)
SOURCES = ("compiled_decode.py", "llama.py", "kv_cache.py", "quantize.py", "q4_matmul.py")


class _InputCache:
    """Row 0 of the KV cache as the compiled step's inputs, a view (1, KV, positions, D) per layer
    for keys and one for values: what Attention.forward reads and writes of a KVCache, for one row."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.k, self.v = k, v

    def decode_slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return positions  # one row, row 0: where it writes is its position

    def write_decode(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     write_kv: object = None) -> None:  # compiled: Attention.forward passes no write_kv
        self.k[layer].index_copy_(2, slots, k.unsqueeze(0))  # (KV, 1, D) at (1, KV, positions, D)
        self.v[layer].index_copy_(2, slots, v.unsqueeze(0))


class _Layers(torch.nn.Module):
    """A decode step's layers and final norm over the cache rows given as inputs; the head left out."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model.model
        self.register_buffer("rope_cos", model.rope_cos)
        self.register_buffer("rope_signed_sin", model.rope_signed_sin)
        self._forward = LlamaForCausalLM._forward.__get__(self)  # reads model, rope_cos, rope_signed_sin

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, k: list[torch.Tensor],
                v: list[torch.Tensor]) -> torch.Tensor:
        rows = torch.zeros_like(tokens)  # row 0: a decode step's one token, or a verify step's n
        return self.model.norm(self._forward(tokens, positions, rows, mask, (), _InputCache(k, v)))


def cache_dir() -> Path:
    """$ENGINE_COMPILE_CACHE, else ~/.cache/engine-bench/compiled/."""
    env = os.environ.get("ENGINE_COMPILE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "engine-bench" / "compiled"


def library_key(model: LlamaForCausalLM, cache: KVCache, setting: dict[str, object]) -> str:
    """A digest of everything the library bakes in: the model's tensors (bytes, names, shapes), the
    cache's shape but its rows, the code it is compiled from, torch's version, the CPU and the threads, and
    `setting` (the precision and quantization the copies were made with)."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES:
        digest.update((here / name).read_bytes())
    shape = [n for i, n in enumerate(cache.k.shape) if i != 1]  # (layers, KV, positions, D): not the rows
    facts = {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
             "threads": torch.get_num_threads(), "cache": shape, "cache_dtype": str(cache.k.dtype), **setting}
    digest.update(json.dumps(facts, sort_keys=True, default=str).encode())
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()[:32]


class CompiledDecode:
    """`model.decode` of one row through the AOTInductor library; other row counts, and a row that
    attends the whole context, through `fallback` (the traced step). Compiles the library into
    `directory` unless it is there. With `add_verify`, a second library for one row's verify step of
    n tokens (`verify`)."""

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, fallback: Decode, directory: Path,
                 setting: dict[str, object]) -> None:
        self._model, self._cache, self._fallback = model, cache, fallback
        self._directory, self._setting = directory, setting
        layers = cache.k.shape[0]
        self._k = [cache.k[layer, :1] for layer in range(layers)]  # row 0's views: the inputs
        self._v = [cache.v[layer, :1] for layer in range(layers)]
        self._step, self.package = self._library("decode", 1, setting)
        self.verify_tokens = 0  # and its library, once add_verify has made or loaded it
        self._verify: Callable[..., torch.Tensor] | None = None
        self.verify_package: Path | None = None

    def add_verify(self, tokens: int) -> None:
        """Compile (or load) the library of one row's verify step of `tokens` tokens (speculation's
        last token and padded draft). A traced verify step of 7 tokens ran SmolLM2's operators one by
        one: 22-24 ms against the compiled one-row step's 5-6 (torch profiler: 12 of its 25.6 ms
        were small operators; int4 copies, Xeon 207 with AMX)."""
        self._verify, self.verify_package = self._library("verify", tokens, {**self._setting, "verify_tokens": tokens})
        self.verify_tokens = tokens

    def _library(self, name: str, tokens: int, setting: dict[str, object]) -> tuple[Callable[..., torch.Tensor], Path]:
        started = time.monotonic()
        key = library_key(self._model, self._cache, setting)
        package = self._directory / f"{name}-{key}.pt2"
        compiled_now = not package.exists()
        if compiled_now:
            self._compile(package, tokens)
            compile_cache.prune(self._directory)  # libraries no engine has loaded for a month
        try:
            step = torch._inductor.aoti_load_package(str(package))
        except RuntimeError as err:  # a library left by another torch build, or damaged on disk
            raise RuntimeError(f"loading the compiled {name} step {package}: {err}; delete the file to "
                               "compile it again") from err
        compile_cache.touch(package)
        log.info("decode_compiled", package=str(package), tokens=tokens, compiled=compiled_now,
                 seconds=round(time.monotonic() - started, 1))
        return step, package

    @torch.no_grad()
    def _compile(self, package: Path, n: int) -> None:
        """Export and compile one row's step of `n` tokens into `package`."""
        cache = self._cache
        tokens = torch.zeros(n, dtype=torch.long, device=cache.k.device)
        positions = torch.arange(2, n + 2, device=cache.k.device)  # attends n + 2: not a fixed length
        # not the whole context: its guard (the narrow equal to the cache) export refuses to leave
        # open, so a row's last position, the context's, goes to the fallback
        length = torch.export.Dim("length", min=n + 1, max=cache.max_context - 1)
        started = time.monotonic()
        log.info("decode_compile_started", package=str(package), tokens=n,
                 note="AOTInductor: about a minute or two on 2 cores, once per model, precision and CPU")
        exported = torch.export.export(_Layers(self._model), (tokens, positions, rows_mask(positions[None, :]), self._k,
                                                              self._v),
                                       dynamic_shapes=({}, {}, {3: length}, [{}] * len(self._k), [{}] * len(self._v)),
                                       strict=False)
        exported_s = time.monotonic() - started
        package.parent.mkdir(parents=True, exist_ok=True)
        partial = package.with_suffix(f".{os.getpid()}-partial.pt2")  # renamed once whole: no half library is loaded
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(partial),
            inductor_configs={"cpp.threads": torch.get_num_threads()})  # the kernels' OpenMP team, as keyed
        partial.replace(package)
        log.info("decode_compile_done", export_seconds=round(exported_s, 1),
                 compile_seconds=round(time.monotonic() - started - exported_s, 1))

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """(n, V): row 0's logits fed `tokens` at `positions`, both (1, n), through the verify
        library, as TracedVerify gives them; None where it does not serve (none added, another n,
        or the context's last position)."""
        if self._verify is None or tokens.shape[1] != self.verify_tokens:
            return None
        mask = rows_mask(positions)
        if mask.shape[-1] == self._cache.max_context:
            return None
        hidden = self._verify(tokens[0], positions[0], mask, self._k, self._v)
        return self._model.head(hidden).float()

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """As `LlamaForCausalLM.decode` on the cache given at construction."""
        if tokens.shape[0] != 1:  # before the mask: the trace makes its own (a host sync each)
            return self._fallback(tokens, positions)
        mask = decode_mask(positions)
        if mask.shape[-1] == self._cache.max_context:
            return self._fallback(tokens, positions)
        hidden = self._step(tokens, positions, mask, self._k, self._v)
        return self._model.head(hidden).float()
