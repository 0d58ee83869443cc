"""The model: a Llama-family decoder in torch and everything that reads it from disk.

llama.py (the decoder and its one step over decode rows and prompt chunks), kv_cache.py (the
cache's rows), quantize.py (int4/int8 weight copies and their matmuls), traced_decode.py (the
decode step captured with TorchScript), the checkpoint readers (GGUF, Hugging Face safetensors),
tokenizers and chat templates, and the presets. A new kernel or a new architecture goes here;
nothing here knows about requests or scheduling.
"""
