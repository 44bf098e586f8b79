"""The PyTorch reference models the tests and the model benchmark compare with.

transformers' own GGUF conversion (`load_gguf_checkpoint`: gguf's dequantize,
its own Q/K un-permutation and Gemma norm handling) feeding `LlamaForCausalLM`
/ `Gemma3ForCausalLM` built from the config transformers derives from the file.
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` does the same but
insists on the `accelerate` package, which the test extras do not install.)
torch is a test-only dependency: brf itself never imports this module.
"""

import gguf
import torch
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint


def reference_model(path: str, attn: str = "eager", threads: int | None = None):
    """A float32 PyTorch model of a GGUF file, in eval mode."""
    if threads:
        torch.set_num_threads(threads)
    reader = gguf.GGUFReader(path)  # parse once; load_gguf_checkpoint asks for it twice
    real = gguf.GGUFReader
    gguf.GGUFReader = lambda p, *a, **k: reader if p == path else real(p, *a, **k)
    try:
        config = transformers.AutoConfig.for_model(
            **load_gguf_checkpoint(path, return_tensors=False)["config"])
        config._attn_implementation = attn
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    finally:
        gguf.GGUFReader = real
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
