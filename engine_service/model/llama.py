"""A Llama-family decoder (Llama, Mistral, Qwen2): RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU, over the static KV cache of `kv_cache.py`.

Module names equal Hugging Face's, so a checkpoint's state dict loads through the one mapping in
`checkpoint.py`. Shapes in comments: B batch rows, T tokens, H heads, KV key/value heads,
G = H // KV, D head dim, L attended length.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine_service.model.config import ModelConfig
from engine_service.model.decode_attention import DecodeAttention
from engine_service.model.kv_cache import KVCache, PromptChunk, additive_mask, chunk_mask, decode_mask
from engine_service.model.layer_ops import LayerOps
from engine_service.model.prompt_attention import PromptAttention
from engine_service.model.quantize import QuantizedWeight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # the engine's operators where set (LlamaForCausalLM.use_layer_ops): one call, not seven
        self.ops: LayerOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and not torch.compiler.is_compiling():  # the compiled step fuses torch's
            return self.ops.rms_norm(x, self.weight, self.eps)
        # normalised in float32 and scaled in the model's dtype, in Hugging Face's own operators:
        # the same bits as F.rms_norm, whose CPU kernel is a composite of more of them (traced, one
        # 576-wide row, 2 threads, Zen 4: 12.5 us against 18.1)
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the configured scaling applied."""
    dim = config.dim_per_head
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[arg-type]
    if kind == "llama3":
        factor = float(scaling["factor"])  # type: ignore[arg-type]
        low = float(scaling["low_freq_factor"])  # type: ignore[arg-type]
        high = float(scaling["high_freq_factor"])  # type: ignore[arg-type]
        old_context = float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type must be one of default, linear, llama3, got {kind!r}")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` with a weight in oneDNN's blocked layout (`Packed.pack_onednn`), through a
    scripted function: the tracer cannot record the op's empty list of scalars, but records a call
    of the function. A trace can read `weight` only as an attribute of the traced module
    (traced_decode._Step registers each one), never as a constant (TorchScript has none of an
    opaque layout). Scripted at its first call, not at import: a torch without oneDNN's op still
    imports the model (precision.choose_onednn_weights decides whether weights are prepacked)."""
    return _scripted_onednn_linear()(x, weight, bias)


@functools.cache
def _scripted_onednn_linear() -> torch.jit.ScriptFunction:
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return torch.jit.script(linear)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `x * cos + rotate_half(x) * sin` in fewer operations: rotate_half(x) is the
    halves of x swapped with the first negated, so it equals roll(x) * [-1.., +1..], and the sign
    lives in `signed_sin` (see `setup_rope`). Bit-identical: negation is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


# A prompt chunk of at least this many tokens from a position past 0 attends in two parts merged
# by their log-sum-exp (`attend_after_prefix`), not under a mask: a masked call computes every
# query against every key, the chunk's later keys too (no causal skip). SmolLM2's heads, bfloat16,
# 2 threads, AMD EPYC of the Zen 4 class, medians of 9, ms, masked (the mask built too) / merged
# with a KV head's queries folded into one call: 640 tokens at 128 8.7 / 8.0, at 512 13.3 / 12.1,
# at 1,024 19.4 / 16.6, at 1,536 24.9 / 21.5; 512 at 128 5.9 / 6.2, at 512 9.3 / 10.4, at 1,536
# 18.5 / 16.2; 384 at 512 6.2 / 7.6 (below 640 tokens two calls and the merge cost about what the
# masked part wastes); 1,280 at 768 46.2 / 32.6; a causal 2,000 from 0: 38.5. Until later on
# 2026-12-06 the merged form repeated the keys for each query head and began at 1,024
# tokens: 1,024 at 1,024 32.9, 1,280 at 768 36.5.
SPLIT_ATTENTION_TOKENS = 640


def attend_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """The attention of q (1, H, T, D), T tokens at positions start..start+T-1 (start > 0), over
    k and v (1, KV, start + T, D) as a chunk mask says: the cached positions 0..start-1, unmasked,
    and the chunk's own causally, each by torch's CPU flash attention, which gives its log-sum-exp,
    merged by those (the softmax over both parts). Within float rounding of the masked call. The
    cached part takes each KV head's group of query heads as one call's queries (H / KV heads x T
    rows against that head's keys, none copied: unmasked, a query row is a query row); the chunk's
    own part, causal, needs its rows in position order, so its T keys are repeated for each head."""
    heads, kv, tokens, dim = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    prefix, prefix_lse = flash(q.reshape(1, kv, heads // kv * tokens, dim), k[:, :, :start], v[:, :, :start], 0.0,
                               False)
    prefix, prefix_lse = prefix.reshape(1, heads, tokens, dim), prefix_lse.reshape(1, heads, tokens)
    own_k, own_v = k[:, :, start:], v[:, :, start:]
    if kv != heads:  # a KV head for each group of query heads
        own_k, own_v = own_k.repeat_interleave(heads // kv, 1), own_v.repeat_interleave(heads // kv, 1)
    own, own_lse = flash(q, own_k, own_v, 0.0, True)
    lse = torch.logaddexp(prefix_lse, own_lse)  # (1, H, T), float32
    return (prefix * (prefix_lse - lse).exp().unsqueeze(-1) + own * (own_lse - lse).exp().unsqueeze(-1)).to(q.dtype)


class Packed(nn.Module):
    """One or several projections of one input as one matmul: their weights (and biases)
    concatenated by output row. The `nn.Linear` modules keep their names for checkpoints and state
    dicts; `pack` turns their parameters into views of the packed tensors, so memory is not doubled
    (one part is used as it is, which keeps a tied LM head tied). `quantized`, when set
    (quantize.py), serves calls of at most its `max_rows` rows; `onednn`, when set
    (`pack_onednn`), serves the others."""

    def __init__(self, *parts: nn.Linear) -> None:
        super().__init__()
        self._parts = parts  # a plain tuple: not registered twice as submodules
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.quantized: QuantizedWeight | None = None
        self.onednn: torch.Tensor | None = None

    def __setattr__(self, name: str, value: object) -> None:
        if name == "quantized":  # a copy that is a module (DynamicInt8Weight) is registered, others not: either replaces either
            self._modules.pop(name, None)
            self.__dict__.pop(name, None)
        super().__setattr__(name, value)

    def pack(self) -> None:
        parts = self._parts
        self.onednn = None  # a copy of the weights packed before: pack_onednn again for these
        if len(parts) == 1:  # plain tensors sharing the parameters' storage (a Parameter would register here)
            bias = parts[0].bias
            self.weight, self.bias = parts[0].weight.detach(), None if bias is None else bias.detach()
            return
        with torch.no_grad():
            self.weight = torch.cat([p.weight for p in parts])
            self.bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])  # type: ignore[misc]
            start = 0
            for part in parts:
                size = part.out_features
                part.weight = nn.Parameter(self.weight[start:start + size], requires_grad=False)
                if self.bias is not None:
                    part.bias = nn.Parameter(self.bias[start:start + size], requires_grad=False)
                start += size

    def pack_onednn(self, rows: int = 1) -> None:
        """Keep a copy of the (bfloat16) weight in oneDNN's blocked layout for calls of `rows` rows,
        which `F.linear` would otherwise reorder the weight into on every call: the same kernel and
        the same bits where the layout is the one F.linear picks (with AMX, 64 rows and not 1:
        machine/precision.onednn_layout_rows), without the reorder. SmolLM2's gate/up (3,072 x 576),
        2 threads, Zen 4, ms at 8/40/128/2,000 rows: 0.095/0.343/1.06/16.8 against
        0.215/0.503/1.22/18.5. Traced steps read it as their module's attribute (`onednn_linear`)."""
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        if q is not None and x.numel() <= q.max_rows * x.shape[-1]:
            out = q.matmul(x)
            return out if self.bias is None else out + self.bias
        if self.onednn is not None:
            return onednn_linear(x, self.onednn, self.bias)
        return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.dim_per_head
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv = Packed(self.q_proj, self.k_proj, self.v_proj)
        self.out = Packed(self.o_proj)
        # the decoding rows' attention, one token a row: the engine's kernel where set
        # (LlamaForCausalLM.use_decode_attention), else scaled_dot_product_attention with the mask
        self.decode_kernel: DecodeAttention | None = None
        # prompt chunks' attention (the traced mixed step's chunk too): the engine's kernel where set
        # (LlamaForCausalLM.use_prompt_attention), else scaled_dot_product_attention
        self.prompt_kernel: PromptAttention | None = None
        self.ops: LayerOps | None = None  # the engine's rope and write_kv where set (LlamaForCausalLM.use_layer_ops)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # type: ignore[no-untyped-def]
        """cos/sin (B, T, 1, D). Rotary is applied to q and k together, as one tensor."""
        h, kv = self.heads, self.kv_heads
        qk, v = self.qkv(x).unflatten(-1, (h + 2 * kv, self.head_dim)).split((h + kv, kv), dim=2)
        rotated = (apply_rope(qk, cos, sin) if self.ops is None or torch.compiler.is_compiling()
                   else self.ops.rope(qk, cos, sin))
        q, k = rotated.split((h, kv), dim=2)  # (B, T, H + KV, D) rotated
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D), (B, KV, T, D) x 2

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
                slots: torch.Tensor, mask: torch.Tensor | None, chunks: Sequence[PromptChunk],
                masks: Sequence[torch.Tensor | None], cache: KVCache, tail: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None) -> torch.Tensor:
        """x (1, M, hidden): first d decoding tokens, n for each of rows 0..b-1 in turn (n = 1 but
        in a verify step), attending as `mask` (b, 1, n, L) says (with n = 1, row r's keys
        0..lengths[r]-1, which `decode_kernel` reads where set); then, where `tail` is given, one
        prompt chunk of C tokens in row b, attending as `tail` (C, L') says (additive); else the
        chunks' tokens, one chunk after another. The first d (+ C) tokens are written to the cache
        at `slots` (KVCache.decode_slots of `rows` (d + C,), their rows). The projections run over
        all M tokens at once; attention reads views of the cache, never a gather: the decoding rows
        as one batch, each chunk over its own row, as its mask in `masks` says (None: a chunk from
        position 0, plain causal, or past it, attend_after_prefix), or in `prompt_kernel` where set
        (causal at the chunk's positions, no mask). A tail chunk is what a traced mixed step takes (no Python int
        of its row or positions: LlamaForCausalLM.mixed_step)."""
        width = self.heads * self.head_dim
        gqa = self.heads != self.kv_heads
        q, k, v = self._qkv(x, cos, sin)  # q (1, H, M, D), k/v (1, KV, M, D)
        written = rows.shape[0]
        d = written if tail is None else written - tail.shape[0]
        outs = []
        if written:
            cache.write_decode(self.layer, slots, k[0].narrow(1, 0, written), v[0].narrow(1, 0, written),
                               None if torch.compiler.is_compiling() or self.ops is None else self.ops.write_kv)
        if d:
            b, n, length = mask.shape[0], mask.shape[2], mask.shape[-1]  # type: ignore[union-attr]
            g, kv, dim = self.heads // self.kv_heads, self.kv_heads, self.head_dim
            # the G query heads that share a KV head as G query rows against it, (b, KV, G, D):
            # the same attention as enable_gqa's (head h reads KV head h // G), in a fraction of
            # its time on CPU (bfloat16, SmolLM2, one row at 210 positions, 1 thread: 38 us
            # against 199; 8 rows 246 against 1,551; 32 rows 1,006 against 6,413)
            if n == 1:
                qd = q[0].narrow(1, 0, d).transpose(0, 1).reshape(b, kv, g, dim)
            else:  # n tokens a row (a verify step): (b, KV, G * n, D), head-major, and the mask's rows alike
                qd = q[0].narrow(1, 0, d).unflatten(1, (b, n)).transpose(0, 1).reshape(b, kv, g * n, dim)
                mask = mask.repeat(1, 1, g, 1)  # type: ignore[union-attr]
            if n == 1 and self.decode_kernel is not None:  # the cache's rows 0..b-1, row r's first lengths[r] positions
                out = self.decode_kernel(qd, cache.k[self.layer], cache.v[self.layer], lengths, self.scale)
            else:
                out = F.scaled_dot_product_attention(qd, cache.k[self.layer].narrow(0, 0, b).narrow(2, 0, length),
                                                     cache.v[self.layer].narrow(0, 0, b).narrow(2, 0, length),
                                                     attn_mask=mask)
            if n > 1:  # back to token order: (b, n, KV, G, D)
                out = out.unflatten(2, (g, n)).permute(0, 3, 1, 2, 4)
            outs.append(out.reshape(d, width))
        if tail is not None:  # in row b = mask.shape[0], its keys and values written above
            row, length = mask.shape[0], tail.shape[-1]  # type: ignore[union-attr]
            keys = cache.k[self.layer].narrow(0, row, 1).narrow(2, 0, length)
            values = cache.v[self.layer].narrow(0, row, 1).narrow(2, 0, length)
            if self.prompt_kernel is not None:  # the keys through the chunk say where it starts: no int traced
                outs.append(self.prompt_kernel(q[0].narrow(1, d, tail.shape[0]), keys[0], values[0], self.scale))
            else:
                out = F.scaled_dot_product_attention(q.narrow(2, d, tail.shape[0]), keys, values, attn_mask=tail,
                                                     enable_gqa=gqa)
                outs.append(out[0].transpose(0, 1).reshape(tail.shape[0], width))
        at = d
        for chunk, chunk_mask_ in zip(chunks, masks, strict=True):
            row, start, end = chunk.row, chunk.start, chunk.start + chunk.length
            cache.k[self.layer, row, :, start:end] = k[0, :, at:at + chunk.length]
            cache.v[self.layer, row, :, start:end] = v[0, :, at:at + chunk.length]
            keys, values = cache.k[self.layer, row:row + 1, :, :end], cache.v[self.layer, row:row + 1, :, :end]
            if self.prompt_kernel is not None:  # causal at the chunk's positions, no mask: (T, width)
                outs.append(self.prompt_kernel(q[0, :, at:at + chunk.length], keys[0], values[0], self.scale))
                at += chunk.length
                continue
            if start and chunk_mask_ is None:  # a large chunk past position 0 (SPLIT_ATTENTION_TOKENS)
                out = attend_after_prefix(q[:, :, at:at + chunk.length], keys, values, start)
            else:
                out = F.scaled_dot_product_attention(q[:, :, at:at + chunk.length], keys, values, attn_mask=chunk_mask_,
                                                     is_causal=chunk_mask_ is None, enable_gqa=gqa)  # (1, H, T, D)
            outs.append(out[0].transpose(0, 1).reshape(chunk.length, width))
            at += chunk.length
        return self.out((outs[0] if len(outs) == 1 else torch.cat(outs)).unsqueeze(0))  # (1, M, width)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up = Packed(self.gate_proj, self.up_proj)
        self.down = Packed(self.down_proj)
        self.size = config.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.size, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # its table left uninitialised (every loader assigns it, init_random fills it): nn.Embedding's
        # own normal_ init, on the meta device the checkpoint readers build on, goes through
        # torch._refs and imports torch._dynamo, 1.5-2 s of an engine's start where nothing else does
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder with its LM head. Once the weights are in place, call `pack_projections` (and
    again after loading others), then `setup_rope` for the context to serve."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head = Packed(self.lm_head)

    def pack_projections(self) -> None:
        """Pack the q/k/v and gate/up projections (`Packed`); call once the weights are in place (and
        again after loading others), before a step and before any quantization."""
        for packed in self.projections():
            packed.pack()

    def setup_rope(self, max_positions: int, device: torch.device) -> None:
        """Precompute the rotary cos/sin tables (float32, as Hugging Face computes them, then in the
        model's dtype) for every position below `max_positions`; again for another context.

        Attention here is over the full context, which equals sliding-window attention only while
        the context fits in the window, so a larger `max_positions` is refused."""
        window = self.config.sliding_window
        if window is not None and max_positions > window:
            raise ValueError(
                f"max context {max_positions} exceeds the model's sliding_window {window}; "
                f"serve at most {window} tokens (sliding-window attention is not implemented)"
            )
        inv_freq = rope_inv_freq(self.config).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        dtype = self.model.embed_tokens.weight.dtype
        self.rope_cos = emb.cos().to(dtype)
        sin = emb.sin().to(dtype)
        half = sin.shape[-1] // 2
        self.rope_signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # see apply_rope

    def use_decode_attention(self, kernel: DecodeAttention | None) -> None:
        """Decoding rows' attention, one token a row, in `kernel` (model/decode_attention.py's
        operator), or scaled_dot_product_attention with None. Before any trace or compile is made:
        each bakes in the attention it ran."""
        for layer in self.model.layers:
            layer.self_attn.decode_kernel = kernel

    def use_prompt_attention(self, kernel: PromptAttention | None) -> None:
        """Prompt chunks' attention in `kernel` (model/prompt_attention.py's operator), or
        scaled_dot_product_attention with None. Before any trace is made, as use_decode_attention."""
        for layer in self.model.layers:
            layer.self_attn.prompt_kernel = kernel

    @property
    def prompt_attention(self) -> bool:
        """Whether prompt chunks' attention runs in the engine's kernel (use_prompt_attention)."""
        return bool(self.model.layers) and self.model.layers[0].self_attn.prompt_kernel is not None

    def use_layer_ops(self, ops: LayerOps | None) -> None:
        """The layers' norms, rotary embeddings and cache writes outside the compiled step in `ops`
        (model/layer_ops.py's operators, for a bfloat16 model), or in torch's operators with None.
        Before any trace is made: each bakes in the operators it ran."""
        for layer in self.model.layers:
            layer.input_layernorm.ops = layer.post_attention_layernorm.ops = ops
            layer.self_attn.ops = ops
        self.model.norm.ops = ops

    @property
    def decode_attention(self) -> str | None:
        """The decoding rows' attention kernel's operator name (use_decode_attention), None for torch's."""
        kernel = self.model.layers[0].self_attn.decode_kernel if self.model.layers else None
        return None if kernel is None else str(kernel)

    def projections(self) -> list[Packed]:
        """Every matmul of a step, in order, the LM head last (quantize_model quantizes these)."""
        out: list[Packed] = []
        for layer in self.model.layers:
            out += [layer.self_attn.qkv, layer.self_attn.out, layer.mlp.gate_up, layer.mlp.down]
        return [*out, self.head]

    def init_random(self, seed: int) -> None:
        """Random weights from a fixed seed (normal, std 0.02, as Hugging Face initialises)."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.model.norm(hidden)).float()

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: KVCache, first_row: int,
                all_logits: bool = False) -> torch.Tensor:
        """Whole right-padded prompts `tokens` (B, T) with true `lengths` (B,) into cache rows
        first_row..first_row+B-1 (`step` with each prompt one chunk at position 0, nothing
        decoding). Returns the logits of each prompt's last token (B, V), or of every position
        (B, T, V) when `all_logits` (zeros past a prompt's length)."""
        b, t = tokens.shape
        lens = [int(n) for n in lengths.tolist()]
        flat = torch.cat([tokens[i, :n] for i, n in enumerate(lens)])
        chunks = [PromptChunk(first_row + i, 0, n) for i, n in enumerate(lens)]
        none = flat[:0]
        if not all_logits:
            return self.step(none, none, flat, chunks, cache, logits_of=range(b))
        every = self.step(none, none, flat, chunks, cache)  # (N, V)
        out = every.new_zeros(b, t, every.shape[-1])
        at = 0
        for i, n in enumerate(lens):
            out[i, :n] = every[at:at + n]
            at += n
        return out

    @torch.inference_mode()
    def step(self, decode_tokens: torch.Tensor, decode_positions: torch.Tensor, chunk_tokens: torch.Tensor,
             chunks: Sequence[PromptChunk], cache: KVCache, logits_of: Collection[int] | None = None,
             every_token_of: Collection[int] = ()) -> torch.Tensor:
        """One step of continuous batching as one pass over the weights: rows 0..d-1 decode one
        token each (`decode_tokens` at `decode_positions`, both (d,)), and `chunks` of prompts
        prefill, their tokens one after another in `chunk_tokens` (N,), nothing padded. A chunk's
        keys and values go into its row at its positions, and it attends to the row's cached
        positions before it. Returns (d + K, V): the decoding rows' logits, then, chunk by chunk in
        order, every token's of a chunk numbered in `every_token_of` (a speculative draft being
        verified, a prompt whose log-probabilities are asked for), or the last token's of a chunk
        numbered in `logits_of`; or every chunk token's (d + N, V) when `logits_of` is None."""
        device = chunk_tokens.device
        d = decode_tokens.shape[0]
        chunk_positions = [torch.arange(c.start, c.start + c.length) for c in chunks]
        positions = torch.cat([decode_positions, *(p.to(device) for p in chunk_positions)])
        mask = decode_mask(decode_positions) if d else None
        hidden = self._forward(torch.cat([decode_tokens, chunk_tokens]), positions, torch.arange(d, device=device),
                               mask, chunks, cache)
        if logits_of is None:
            return self._logits(hidden)
        every, last = set(every_token_of), set(logits_of)
        picked, at = list(range(d)), d
        for i, c in enumerate(chunks):
            if i in every:
                picked.extend(range(at, at + c.length))
            elif i in last:
                picked.append(at + c.length - 1)
            at += c.length
        return self._logits(hidden[torch.tensor(picked, dtype=torch.long, device=device)])

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token for each of rows 0..B-1: `tokens` (B,) at `positions` (B,). Returns (B, V)."""
        return self.decode_step(tokens, positions, decode_mask(positions), cache)

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                    cache: KVCache) -> torch.Tensor:
        """The body of `decode`, free of host synchronisation (a graph a compiler could take whole)."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return self._logits(self._forward(tokens, positions, rows, mask, (), cache))

    def verify_step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                    cache: KVCache) -> torch.Tensor:
        """Rows 0..B-1 fed n tokens each, `tokens` and `positions` (B, n), attending as `mask`
        (B, 1, n, L: `kv_cache.rows_mask`) says: a verify step's rows, each its last token and its draft,
        as a decode step takes them (free of host synchronisation, so a trace takes it whole).
        Returns (B * n, V), row-major. A decode step is the case n = 1."""
        b, n = tokens.shape
        rows = torch.arange(b, device=tokens.device).repeat_interleave(n)
        return self._logits(self._forward(tokens.reshape(-1), positions.reshape(-1), rows, mask, (), cache))

    def mixed_step(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                   tail: torch.Tensor, picked: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """`step` with rows 0..b-1 decoding (b = mask.shape[0], `mask` a decode_mask) and one prompt
        chunk of C tokens in row b (`tail`: its chunk_mask (C, L)), in the form a trace takes whole:
        `tokens` and `positions` (b + C,), the decoding rows' then the chunk's, and `rows` (b + C,),
        each token's row, say where every key and value goes (KVCache.decode_slots), so no row or
        position is a Python int. Returns the logits of the tokens numbered in `picked` (K,): the
        decoding rows', then the chunk's last token's where it ends its prompt; the same rows and
        bits as `step` (tests/test_traced_decode.py; the LM head's 8-bit activations share one scale
        over its rows, so no other row may go through it)."""
        hidden = self._forward(tokens, positions, rows, mask, (), cache, tail)
        return self._logits(hidden.index_select(0, picked))

    @torch.inference_mode()
    def prefill_sublayers(self, tokens: torch.Tensor, hidden: torch.Tensor | None, chunk: PromptChunk,
                          sublayers: range, cache: KVCache) -> torch.Tensor:
        """One prompt chunk alone through `sublayers`, nothing decoding: 2i is layer i's attention
        (its norm, projections and attention, added to the residual), 2i + 1 its MLP. From the
        chunk's `tokens` (T,) where `hidden` is None (the span starts at 0), else from the span
        before's output `hidden` (T, hidden). Its keys and values in those layers go into its row;
        returns the output (T, hidden). Spans that cover the sublayers in turn give the bits of
        `step` with the chunk alone (tests/test_sliced_prefill.py)."""
        positions = torch.arange(chunk.start, chunk.start + chunk.length, device=tokens.device)
        return self._forward(tokens, positions, positions[:0], None, (chunk,), cache, hidden=hidden,
                             sublayers=sublayers)

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings (T, hidden) of `tokens` (T,): the input of sublayer 0 (prefill_sublayers)."""
        return self.model.embed_tokens(tokens)

    def chunk_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits (1, V) of a chunk's last token from its last layer's output `hidden` (T, hidden)."""
        return self._logits(hidden[-1:])

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None,
                 chunks: Sequence[PromptChunk], cache: KVCache, tail: torch.Tensor | None = None,
                 hidden: torch.Tensor | None = None, sublayers: range | None = None) -> torch.Tensor:
        """The layers over M tokens (see `Attention.forward`; `tail` boolean here); returns the final
        hidden states (M, hidden). Or the span `sublayers` of them only (prefill_sublayers), from
        `hidden` (M, hidden) where given, the span before's output, instead of the embeddings."""
        m = positions.shape[0]
        cos = self.rope_cos[positions].view(1, m, 1, -1)  # (B=1, T=M, 1, D)
        sin = self.rope_signed_sin[positions].view(1, m, 1, -1)
        slots = cache.decode_slots(rows, positions[:rows.shape[0]])  # once for every layer
        # a chunk from position 0 is plain causal attention: is_causal skips the blocks above the
        # diagonal, the same bits as the mask (SmolLM2, bfloat16, 2 threads, Xeon, ms a layer at
        # 1,000/2,000 tokens: 15/50 against 22/85)
        x = (self.model.embed_tokens(tokens) if hidden is None else hidden).unsqueeze(0)  # (1, M, hidden)
        # boolean masks made additive once here, not by attention in each layer (kv_cache.additive_mask)
        # (none for a chunk from position 0, causal, nor for a large chunk past it on a CPU: attend_after_prefix,
        # nor where the engine's prompt attention serves: use_prompt_attention; the layers' own attribute,
        # since the compiled step runs this method on a module of its own, with no chunk)
        masks = [additive_mask(chunk_mask(c, positions.device), x.dtype)
                 if c.start and self.model.layers[0].self_attn.prompt_kernel is None
                 and (c.length < SPLIT_ATTENTION_TOKENS or positions.device.type != "cpu") else None for c in chunks]
        # one token a row: row r attends its keys 0..positions[r] (what decode_kernel reads)
        lengths = None if mask is None or mask.shape[2] != 1 else positions.narrow(0, 0, mask.shape[0]) + 1
        mask = None if mask is None else additive_mask(mask, x.dtype)
        tail = None if tail is None else additive_mask(tail, x.dtype)
        if sublayers is not None:
            for sub in sublayers:
                layer = self.model.layers[sub // 2]
                if sub % 2:
                    x = x + layer.mlp(layer.post_attention_layernorm(x))
                else:
                    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, rows, slots, mask, chunks, masks,
                                            cache, tail, lengths)
            return x[0]
        for layer in self.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, rows, slots, mask, chunks, masks, cache, tail,
                                    lengths)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x[0]
