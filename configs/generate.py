"""Ensemble generation: members, fusion mode and method, sampler, prompts.

Run (default pair, SmolLM2-135M-Instruct + Gemma 3 270M, union vocabulary, BRF):
  python experiments/generate.py --config=configs/generate.py
A prompt ensemble of one model under two system prompts, mixture sampling:
  python experiments/generate.py --config=configs/generate.py:prompts,me
Tiny random models (seconds; what the config test runs):
  python experiments/generate.py --config=configs/generate.py:tiny
Overrides, JSONL output, prompts from a file:
  python experiments/generate.py --config=configs/generate.py \
      --config.method=linear --config.sampler=greedy --config.max_new_tokens=32 \
      --config.prompts_file=prompts.txt --config.output=/tmp/gen.jsonl
Members, method and weighting from flags (spec strings; PackLLM weights per prompt):
  python experiments/generate.py --config=configs/generate.py \
      --config.members='smollm2-135m-instruct(chat=True), gemma3-270m' \
      --config.method='loglinear(temperature=0.8)' --config.phase='' \
      --config.weighting='perplexity(temperature=1.0)'
Generation on bytes: every member reads the text byte by byte and keeps all the
tokenizations of what was generated (brf/bytes/generate.py); any method, any
sampler, mode 'me' too, for members with any tokenizers:
  python experiments/generate.py --config=configs/generate.py:bytes \
      --config.beam=16 --config.threshold=1e-3 --config.max_new_bytes=200
Speculative fused decoding (the same distribution, fewer forward steps: a drafter
proposes, every member verifies a whole draft in one call):
  python experiments/generate.py --config=configs/generate.py:prompts --config.speculative='ngram(n=3, k=6)'
  python experiments/generate.py --config=configs/generate.py:bytes --config.speculative='member(k=8)'
Top-k union vocabulary instead of the full union:
  python experiments/generate.py --config=configs/generate.py \
      --config.aligner=topk_union --config.aligner_params.k=16

The argument is a comma-separated list of: 'prompts' (one-model prompt
ensemble), 'me' (mode mixture_exact), 'tiny' (tiny random members with the
SmolLM2 tokenizer, 8 tokens), 'bytes' (level='bytes': sample the fused
next-byte distribution).
"""

import ml_collections

from brf.bytes import DEFAULT_BEAM, DEFAULT_THRESHOLD
from brf.errors import UserError
from brf.specs import format_spec


class ConfigArgError(UserError):
    """An unknown config argument (configs/generate.py:<arg>)."""


DEFAULT_PAIR = ("smollm2-135m-instruct", "gemma3-270m")
# The Gemma 3 GGUF carries no chat template; this is Gemma's turn format.
GEMMA_TURN = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


def get_config(arg=None):
    flags = {a.strip() for a in (arg or "").split(",") if a.strip()}
    unknown = flags - {"prompts", "me", "tiny", "bytes"}
    if unknown:
        raise ConfigArgError(f"unknown config argument(s) {sorted(unknown)}; "
                         "use prompts, me, tiny, bytes")
    c = ml_collections.ConfigDict()
    # Members are one spec string (brf.specs), so a flag can set them:
    #   --config.members='smollm2-135m-instruct(chat=True), gemma3-270m(template="...")'
    # Keys: weight, prefix (system prompt), chat, template, name.
    if "prompts" in flags:
        c.members = ", ".join([
            format_spec(DEFAULT_PAIR[0], dict(
                chat=True, weight=0.5,
                prefix="You are a concise assistant. Answer in one sentence.")),
            format_spec(DEFAULT_PAIR[0], dict(
                chat=True, weight=0.5, prefix="You are a poet. Answer with vivid imagery.")),
        ])
    else:
        c.members = ", ".join([
            format_spec(DEFAULT_PAIR[0], dict(chat=True, weight=0.5)),
            format_spec(DEFAULT_PAIR[1], dict(template=GEMMA_TURN, weight=0.5))])
    c.aligner = "auto"            # identity when the vocabularies agree, else union
    c.aligner_params = {"k": 16}  # passed to aligners that declare them (topk_union: k)
    c.mode = "mixture_exact" if "me" in flags else "fuse"
    # A brf.fusion.METHODS spec, e.g. loglinear(temperature=0.8); the mixture modes
    # sample the members' linear pool, so there it must be 'linear'.
    c.method = "linear" if "me" in flags else "born"
    c.phase = "tanh(rate=0.5, offset=[0, 0.5])"  # for methods with a phase map (born); '' = default
    c.method_params = {}
    # '' = the members' weights; 'perplexity(temperature=1.0)' = PackLLM weights
    # per prompt from each member's perplexity on it (brf/ensemble/packllm.py).
    c.weighting = ""
    c.sampler = "" if "me" in flags else "temperature=0.7,top_p=0.9"
    c.choice = "per_sequence"     # mixture modes: per_sequence | shared
    c.max_new_tokens = 48
    c.stop = ()
    c.seed = 0
    c.dtype = "float32"
    c.prompts = ("Write one sentence about the sea.",
                 "What is the capital of France?")
    c.prompts_file = ""           # one prompt a line, or JSONL {"prompt": ...}; replaces prompts
    c.output = ""                 # '' prints each prompt's text; a path writes JSONL ('-': to stdout)
    c.stream = False              # True: print the text as it comes (tagged pieces for several prompts)
    # JAX's persistent compilation cache ($BRF_CACHE/jax_cache): a second run loads
    # the compiled programs (prefill, decoding blocks, speculative rounds)
    c.compilation_cache = True
    # Devices (brf/sharding.py): each member's weights split over 'model', the
    # prompts over 'data'; placement="apart" gives each member its own devices
    # (members run at the same time; data/model then size each member's mesh).
    # 'tokens': fuse next-token distributions (aligned by config.aligner);
    # 'bytes': fuse the members' next-byte distributions (257 events), every
    # member keeping its tokenizations of the text (brf/bytes/generate.py). On
    # bytes: beam and threshold bound each member's hypotheses (beam >= 1,
    # 0 <= threshold < 1; threshold=0 with a large beam is exact; the defaults are
    # brf.bytes', as for byte-level scoring and brf.bytes.generate),
    # max_new_bytes bounds the text, utf8 keeps it valid UTF-8; the aligner,
    # max_new_tokens, weighting and mesh are not used. Generation never merges, so
    # each member's kept mass lower-bounds its probability of the text (reported
    # as 'lost', the pruned log-mass); check_precision=True also rescores the
    # generated text at the reference settings (brf.bytes.REFERENCE; minutes per
    # hundred bytes on a CPU) and reports each member's distance from them.
    c.level = "bytes" if "bytes" in flags else "tokens"
    # Speculative fused decoding (brf/ensemble/speculative.py, brf/bytes/speculative.py;
    # mode 'fuse', either level): '' = off; 'member(k=4)' (the member with the fewest
    # parameters drafts k tokens, or bytes on level='bytes'; index=i picks member i),
    # 'ngram(n=3, k=6)' (no model: copy what followed the latest earlier occurrence
    # of the last n tokens or bytes); adaptive=True moves k between rounds, up to the
    # given one. Drafting pauses (plain compiled steps) while the drafts' acceptance
    # is below what a drafted token costs (cost=c, a share of a plain step; measured
    # defaults in brf/drafting.py; cost=0: never pause; on bytes no draft pays at the
    # default). The text follows exactly the law of plain fused decoding; the
    # acceptance statistics come with the output. Tokens: the members must share one
    # vocabulary.
    c.speculative = ""
    # Where the token level's steps (and speculative rounds) run: 'device' (compiled
    # and looped on the device, nothing read back until a block ends), 'host' (a
    # dispatch per member and stage, each step's result read back), or 'auto' (the
    # device where it applies; speculative rounds on the host on a CPU, where both
    # measured alike). The text is the same either way (sampled speculation: the
    # same law, different random numbers).
    c.engine = "auto"
    c.beam = DEFAULT_BEAM
    c.threshold = DEFAULT_THRESHOLD
    c.max_new_bytes = 192
    c.utf8 = True
    c.check_precision = False
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, placement="shared"))
    if "tiny" in flags:
        c.members = ", ".join(
            format_spec(f"random:{DEFAULT_PAIR[0]}:{i}", dict(chat=True, weight=0.5, prefix=p))
            for i, p in enumerate(("Be brief.", "Be poetic.")))
        c.max_new_tokens = 8
        c.max_new_bytes = 16
        c.stream = False
    return c
