"""Tokenizers for brf models, built without torch.

From a GGUF file: the vocabulary, merges / scores, token types, special ids and
chat template live in its metadata. The tokenizer they describe is built by
transformers' own GGUF builders (`transformers.integrations.gguf.
gguf_tokenizer_mapping`: byte-level BPE for 'gpt2' vocabularies, SentencePiece
BPE with byte fallback for 'llama' ones, with Gemma's fixes). We call those
builders directly on metadata read by `brf.checkpoints.gguf.open_gguf`, because
transformers' own entry point (`AutoTokenizer.from_pretrained(dir, gguf_file=)`)
reads the file with a module that imports torch. The builders import no torch
(tests check `sys.modules` after building both real tokenizers).

One thing we add: llama.cpp's 'smollm' pre-tokenizer splits every digit on its
own before the GPT-2 byte-level split (as SmolLM2's tokenizer.json does, with
`Digits(individual_digits=True)`); transformers' table has no entry for it and
falls back to the plain GPT-2 split. The two agree on SmolLM2 because its merges
contain no digit, but we build the faithful one.

From a Hugging Face directory: its tokenizer.json / tokenizer_config.json, via
`TokenizersBackend.from_pretrained` (`AutoTokenizer` is avoided: importing it
imports torch through transformers.configuration_utils).
"""

from __future__ import annotations

import os
from typing import Any

from tokenizers import pre_tokenizers
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from transformers.integrations.gguf import gguf_tokenizer_mapping as _gguf_tok
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from brf.checkpoints.gguf import GGUFError, GGUFFile, open_gguf

# tokenizer.ggml.model values we build, and tokenizer.ggml.pre values for 'gpt2'.
TOKENIZER_MODELS = ("gpt2", "llama")
_GPT2_PRE = {"smollm", "gpt-2", "default"} | set(_gguf_tok.GGUF_PRE_TOKENIZER_SPLITS)

_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def _tokenizer_dict(meta: dict[str, Any]) -> dict[str, Any]:
    """GGUF metadata -> the dict transformers' GGUF builders take (their key names)."""
    renames = _gguf_tok.GGUF_TOKENIZER_MAPPING["tokenizer"]
    return {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
            if f"tokenizer.{key}" in meta}


def tokenizer_from_gguf(source: str | os.PathLike | GGUFFile) -> PreTrainedTokenizerBase:
    """Builds the fast tokenizer a GGUF file describes.

    Args:
        source: a .gguf path, or a file already opened with `open_gguf`.

    Returns:
        A transformers fast tokenizer (`TokenizersBackend`) with the file's
        BOS / EOS / UNK / PAD tokens, add_bos_token / add_eos_token flags and
        chat template (when the file has one). Control tokens are special
        tokens; user-defined ones are added tokens matched whole.

    Raises:
        GGUFError: no tokenizer in the file, or a tokenizer.ggml.model /
            tokenizer.ggml.pre value this module does not build (named).
    """
    f = source if isinstance(source, GGUFFile) else open_gguf(source)
    meta = f.metadata
    arch = meta.get("general.architecture")
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"{f.path} has no tokenizer (no 'tokenizer.ggml.model' / "
                        "'tokenizer.ggml.tokens' metadata)")
    if model not in TOKENIZER_MODELS:
        raise GGUFError(f"GGUF metadata field 'tokenizer.ggml.model'={model!r} is not supported "
                        f"(supported: {', '.join(TOKENIZER_MODELS)})")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in _GPT2_PRE:
        raise GGUFError(f"GGUF metadata field 'tokenizer.ggml.pre'={pre!r} is not supported "
                        f"for byte-level BPE (supported: {', '.join(sorted(_GPT2_PRE))})")
    if model == "gpt2" and "tokenizer.ggml.merges" not in meta:
        raise GGUFError("GGUF byte-level BPE tokenizer lacks 'tokenizer.ggml.merges'")
    if model == "llama" and "tokenizer.ggml.merges" not in meta and \
            "tokenizer.ggml.scores" not in meta:
        raise GGUFError("GGUF SentencePiece tokenizer has neither 'tokenizer.ggml.merges' nor "
                        "'tokenizer.ggml.scores'")
    tok_dict = _tokenizer_dict(meta)
    backend, _ = _gguf_tok.convert_gguf_tokenizer(arch, tok_dict)
    if model == "gpt2" and pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])

    tokens = tok_dict["tokens"]
    kwargs: dict[str, Any] = {}
    for name, key in _SPECIAL.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None:
            kwargs[name] = tokens[token_id]
    # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise.
    kwargs["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
    kwargs["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if "tokenizer.chat_template" in meta:
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    tok = TokenizersBackend(tokenizer_object=backend, **kwargs)
    if len(tok) != len(tokens):  # e.g. a default special token the file does not have
        extra = sorted(set(tok.get_vocab()) - set(tokens))
        raise GGUFError(f"the tokenizer built from {f.path} has {len(tok)} tokens, the file "
                        f"{len(tokens)} (extra: {extra[:5]}); set tokenizer.ggml.*_token_id")
    return tok


def tokenizer_from_dir(directory: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Loads the tokenizer files of a Hugging Face (or brf checkpoint) directory.

    Args:
        directory: holds tokenizer.json (and usually tokenizer_config.json).

    Returns:
        The transformers fast tokenizer.
    """
    directory = os.fspath(directory)
    if not os.path.exists(os.path.join(directory, "tokenizer.json")):
        raise FileNotFoundError(f"no tokenizer.json in {directory}")
    return TokenizersBackend.from_pretrained(directory)


def load_tokenizer(source: str | os.PathLike) -> PreTrainedTokenizerBase:
    """A tokenizer from a .gguf file or a directory with tokenizer files."""
    source = os.fspath(source)
    if os.path.isdir(source):
        return tokenizer_from_dir(source)
    return tokenizer_from_gguf(source)


__all__ = ["TOKENIZER_MODELS", "load_tokenizer", "tokenizer_from_dir", "tokenizer_from_gguf"]
