"""The PyTorch reference models the tests and the model benchmark compare with.

transformers' own GGUF conversion (`load_gguf_checkpoint`: gguf's dequantize,
its own Q/K un-permutation and Gemma norm handling) feeding `LlamaForCausalLM`
/ `Gemma3ForCausalLM` built from the config transformers derives from the file.
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` does the same but
insists on the `accelerate` package, which the test extras do not install.)
The converted weights are kept as a torch state dict under
``$BRF_CACHE/pt_reference`` (keyed by the file, its size and time, and the
transformers version), so only the first test of a run pays for the conversion.
torch is a test-only dependency: brf itself never imports this module.
"""

import hashlib
import os

import gguf
import torch
import transformers
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from brf.checkpoints.registry import cache_dir


def reference_model(path: str, attn: str = "eager", threads: int | None = None):
    """A float32 PyTorch model of a GGUF file, in eval mode."""
    if threads:
        torch.set_num_threads(threads)
    stored = _stored_path(path)
    if os.path.isfile(stored):
        saved = torch.load(stored, mmap=True, weights_only=True)
    else:
        saved = _convert(path)
        os.makedirs(os.path.dirname(stored), exist_ok=True)
        tmp = f"{stored}.tmp-{os.getpid()}"  # test workers may convert the same file at once
        torch.save(saved, tmp)
        os.replace(tmp, stored)
    config = transformers.AutoConfig.for_model(**saved["config"])
    config._attn_implementation = attn
    with no_init_weights():  # every parameter is loaded below
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(saved["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _convert(path: str) -> dict:
    """transformers' conversion of the file: {"config": its config's fields, "tensors"}."""
    reader = gguf.GGUFReader(path)  # parse once; load_gguf_checkpoint asks for it twice
    real = gguf.GGUFReader
    gguf.GGUFReader = lambda p, *a, **k: reader if p == path else real(p, *a, **k)
    try:
        fields = load_gguf_checkpoint(path, return_tensors=False)["config"]
        with no_init_weights():
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**fields), dtype=torch.float32)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    finally:
        gguf.GGUFReader = real
    return {"config": fields, "tensors": {k: torch.as_tensor(v) for k, v in tensors.items()}}


def _stored_path(path: str) -> str:
    st = os.stat(path)
    key = hashlib.sha256(repr((os.path.abspath(path), st.st_size, st.st_mtime_ns,
                               transformers.__version__)).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "pt_reference", f"{os.path.basename(path)}-{key}.pt")
