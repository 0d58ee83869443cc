"""The frozen architecture description of a Llama-family model."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters, named as in Hugging Face's LlamaConfig where one exists."""

    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling dict as a sorted tuple of items (frozen), or None.
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v (Qwen2)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Every id that ends a sequence (eos_token_id first); a checkpoint may list several.
    stop_token_ids: tuple[int, ...] = ()
    # Mistral-style sliding-window attention; we attend to the full context, so this only bounds
    # the context that may be served (see LlamaForCausalLM.setup_rope).
    sliding_window: int | None = None
    extra: tuple[tuple[str, object], ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model config hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads}) when head_dim is not set"
            )

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """The ids that end generation: `stop_token_ids`, or just `eos_token_id` when none are listed."""
        if self.stop_token_ids:
            return self.stop_token_ids
        return (self.eos_token_id,) if self.eos_token_id is not None else ()

    @property
    def rope_scaling_dict(self) -> dict[str, object] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None
