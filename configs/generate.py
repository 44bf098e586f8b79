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
Top-k union vocabulary instead of the full union:
  python experiments/generate.py --config=configs/generate.py \
      --config.aligner=topk_union --config.aligner_params.k=16

The argument is a comma-separated list of: 'prompts' (one-model prompt
ensemble), 'me' (mode mixture_exact), 'tiny' (tiny random members with the
SmolLM2 tokenizer, 8 tokens).
"""

import ml_collections

DEFAULT_PAIR = ("smollm2-135m-instruct", "gemma3-270m")
# The Gemma 3 GGUF carries no chat template; this is Gemma's turn format.
GEMMA_TURN = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


def get_config(arg=None):
    flags = {a.strip() for a in (arg or "").split(",") if a.strip()}
    unknown = flags - {"prompts", "me", "tiny"}
    if unknown:
        raise ValueError(f"unknown config argument(s) {sorted(unknown)}; "
                         "use prompts, me, tiny")
    c = ml_collections.ConfigDict()
    if "prompts" in flags:
        c.members = [
            dict(model=DEFAULT_PAIR[0], chat=True, weight=0.5,
                 prefix="You are a concise assistant. Answer in one sentence."),
            dict(model=DEFAULT_PAIR[0], chat=True, weight=0.5,
                 prefix="You are a poet. Answer with vivid imagery."),
        ]
    else:
        c.members = [dict(model=DEFAULT_PAIR[0], chat=True, weight=0.5),
                     dict(model=DEFAULT_PAIR[1], template=GEMMA_TURN, weight=0.5)]
    c.aligner = "auto"            # identity when the vocabularies agree, else union
    c.aligner_params = {"k": 16}  # passed to aligners that declare them (topk_union: k)
    c.mode = "mixture_exact" if "me" in flags else "fuse"
    c.method = "born"             # brf.fusion.METHODS (mode 'fuse' only)
    c.phase = "tanh(rate=0.5, offset=[0, 0.5])"  # brf.fusion.PHASE_MAPS; '' = method default
    c.method_params = {}
    c.sampler = "" if "me" in flags else "temperature=0.7,top_p=0.9"
    c.choice = "per_sequence"     # mixture modes: per_sequence | shared
    c.max_new_tokens = 48
    c.stop = ()
    c.seed = 0
    c.dtype = "float32"
    c.prompts = ("Write one sentence about the sea.",
                 "What is the capital of France?")
    c.prompts_file = ""
    c.output = ""                 # '' prints; a path writes JSONL
    c.stream = True
    # Devices (brf/sharding.py): each member's weights split over 'model'.
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1))
    if "tiny" in flags:
        c.members = [dict(model=f"random:{DEFAULT_PAIR[0]}:{i}", chat=True, weight=0.5,
                          prefix=p) for i, p in enumerate(("Be brief.", "Be poetic."))]
        c.max_new_tokens = 8
        c.stream = False
    return c
