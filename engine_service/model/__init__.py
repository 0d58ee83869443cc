"""A Llama-family decoder in torch, its presets, tokenizers and checkpoint loading."""
