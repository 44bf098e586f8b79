"""brf.models: decoder-only transformers of several families as pure functions over
a params pytree, and as flax.nnx modules over the same functions
(`brf.models.modules`).

Registry: :data:`ARCHITECTURES` maps ModelConfig.arch to an
:class:`Architecture` bundling the functions and the module class that serve it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from brf.models.cache import cache_bytes, init_cache, room
from brf.models.config import ModelConfig
from brf.models.modules import (Gemma2, Gemma3, Llama, Mistral, Olmo2, Phi3, Qwen2, Qwen3,
                                Transformer, from_params)
from brf.models.scoring import iter_logits_chunks, score_tokens
from brf.models.transformer import (cast_params, decode_step, decode_step_donated, forward,
                                    forward_tree, init_params, param_shapes, prefill, prefill_donated)
from brf.registry import Registry


class Architecture(NamedTuple):
    """The functions serving one ModelConfig.arch, and its flax.nnx module class."""
    param_shapes: Callable
    init_params: Callable
    init_cache: Callable
    prefill: Callable
    decode_step: Callable
    forward: Callable
    module: type


ARCHITECTURES: Registry[Architecture] = Registry("model architecture")
# Every family shares one code path; ModelConfig fields select the differences.
for _name, _module in (("llama", Llama), ("gemma3", Gemma3), ("qwen2", Qwen2), ("mistral",
                       Mistral), ("qwen3", Qwen3), ("phi3", Phi3), ("gemma2", Gemma2), ("olmo2",
                       Olmo2)):
    ARCHITECTURES.add(_name, Architecture(param_shapes, init_params, init_cache, prefill,
                                          decode_step, forward, _module))

__all__ = ["ARCHITECTURES", "Architecture", "Gemma2", "Gemma3", "Llama", "Mistral", "ModelConfig",
           "Olmo2", "Phi3", "Qwen2", "Qwen3", "Transformer", "cache_bytes", "cast_params",
           "decode_step", "decode_step_donated", "forward", "forward_tree", "from_params",
           "init_cache", "init_params", "iter_logits_chunks", "param_shapes", "prefill",
           "prefill_donated", "room", "score_tokens"]
