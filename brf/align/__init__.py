"""brf.align: vocabulary alignment between ensemble members.

Event spaces and rules are documented in `brf.align.union` (the union event
space: CONTROL + every distinct byte string of a text token) and
`brf.align.aligners` (identity / union / top-k union with its backoff rule).
`brf.align.vocab` reads each token's exact bytes; `brf.align.reencode` turns a
chosen string into each member's own tokens, stably against the text so far.

Typical use::

    tables = [brf.align.load_token_table(m) for m in ("smollm2-135m-instruct",
                                                      "gemma3-270m")]
    align = brf.align.make_aligner("union", tables)
    aligned = align([logits_0, logits_1])          # [..., 2, U] log-probs
    fused = brf.fuse("linear", aligned.logp_XnE)
"""

from brf.align.aligners import (ALIGNERS, Aligned, Aligner, Alignment, IdentityTable,
                                make_aligner, segment_logsumexp, topk_union_logprobs,
                                union_logprobs)
from brf.align.reencode import (Codec, MemberText, Step, encode_bytes, from_ids, make_codec,
                                reencode, start)
from brf.align.union import (CONTROL, UnionTable, build_union, clear_memory_cache,
                             default_cache_dir, load_union, save_union, table_key, union_table)
from brf.align.vocab import (BYTE_LEVEL, SENTENCEPIECE, TokenTable, bytes_to_unicode,
                             decoder_kind, load_token_table, load_tokenizer, token_table)

__all__ = [
    "ALIGNERS", "Aligned", "Aligner", "Alignment", "BYTE_LEVEL", "CONTROL", "Codec",
    "IdentityTable", "MemberText", "SENTENCEPIECE", "Step", "TokenTable", "UnionTable",
    "build_union", "bytes_to_unicode", "clear_memory_cache", "decoder_kind", "default_cache_dir",
    "encode_bytes", "from_ids", "load_token_table", "load_tokenizer", "load_union", "make_aligner", "make_codec",
    "reencode", "save_union", "segment_logsumexp", "start", "table_key", "token_table",
    "topk_union_logprobs", "union_logprobs", "union_table",
]
