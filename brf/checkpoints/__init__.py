"""brf.checkpoints: GGUF / Hugging Face readers, tokenizers, orbax checkpoints and the model cache.

Modules: `gguf` (llama.cpp GGUF -> ModelConfig + params), `hf` (HF safetensors
directories), `tokenizer` (fast tokenizers without torch), `store` (atomic
orbax checkpoint directories), `registry` (model names, sources, the cache).
Import the submodule you need; this package imports nothing eagerly.
"""
