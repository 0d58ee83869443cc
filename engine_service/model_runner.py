"""Runs the model for one step of the decode loop: a batched decode of the running rows and a
batched prefill of the rows just admitted."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from functools import partial

import structlog
import torch

from engine_service.model.llama import KVCache, LlamaForCausalLM
from engine_service.model.quantize import quantize_model
from engine_service.model.traced_decode import TracedDecode
from engine_service.sequence import Sequence

log = structlog.get_logger()


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, max_batch: int, max_context: int, device: torch.device,
                 dtype: torch.dtype, quantize: str = "none", trace_decode: bool = False) -> None:
        self.model = model
        self.device = device
        self.cache = KVCache(model.config, max_batch, max_context, dtype, device)
        model.setup_rope(max_context, device)
        if quantize != "none":
            quantize_model(model, quantize)
        self._decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = partial(model.decode, cache=self.cache)
        if trace_decode:
            try:
                self._decode = TracedDecode(model, self.cache, max_batch)
            except RuntimeError as err:  # the tracer's failures; eager decoding gives the same tokens, slower
                log.warning("decode_trace_failed", error_type=type(err).__name__, error=str(err))

    def forward(self, running: Seq[Sequence], n_old: int) -> torch.Tensor:
        """Logits (n, V) for every running row: rows < n_old decode their last token, rows from
        n_old on (just admitted) prefill their prompt."""
        parts = []
        if n_old:
            old = running[:n_old]
            tokens = torch.tensor([s.generated[-1] for s in old], dtype=torch.long, device=self.device)
            positions = torch.tensor([s.cache_len for s in old], dtype=torch.long, device=self.device)
            parts.append(self._decode(tokens, positions))
        if len(running) > n_old:
            new = running[n_old:]
            lengths = [len(s.request.prompt_ids) for s in new]
            padded = torch.zeros((len(new), max(lengths)), dtype=torch.long)
            for i, s in enumerate(new):
                padded[i, : lengths[i]] = torch.tensor(s.request.prompt_ids, dtype=torch.long)
            parts.append(self.model.prefill(padded.to(self.device), torch.tensor(lengths, device=self.device),
                                            self.cache, n_old))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
