"""Config-driven generation: what experiments/generate.py runs (importable, testable).

A config (configs/generate.py) names the members, the fusion mode and method,
the sampler and the prompts; :func:`run` loads the models once, generates,
and returns one JSON-ready row per prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf import schema as S
from brf import sharding
from brf.ensemble.decode import CHOICES, ENGINES, MODES, Generation, Piece, generate
from brf.ensemble.member import (EnsembleInputError, Member, check_prompts, check_template,
                                 prompt_lines, same_vocabulary)
from brf.errors import UserError
from brf.specs import parse_list, parse_spec


def _random_model(spec: str):
    """'random:<tokenizer source>[:seed]' -> a tiny random model with a real tokenizer."""
    from brf.align.vocab import load_tokenizer
    from brf.models import ModelConfig, init_params
    _, source, *rest = spec.split(":")
    seed = int(rest[0]) if rest else 0
    tok = load_tokenizer(source)
    cfg = ModelConfig(arch="llama", vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=8, d_ff=64, norm_eps=1e-6, rope_theta=10000.0,
                      max_seq_len=2048, tie_embeddings=False,
                      eos_ids=(tok.eos_token_id,) if tok.eos_token_id is not None else ())
    params = init_params(cfg, jax.random.PRNGKey(seed))
    params["final_norm"] = params["final_norm"] * 20.0  # peaked, not uniform, distributions
    return cfg, params, tok


def member_specs(specs: str | Sequence[Any]) -> list[dict]:
    """Member specs as dicts with a 'model' key.

    Args:
        specs: a comma-separated spec string (``brf.specs``), e.g.
            ``'smollm2-135m-instruct(chat=True, weight=0.5), gemma3-270m(weight=0.5)'``,
            or a sequence of such strings or of dicts with a 'model' key.
    """
    out = []
    for name, params in parse_list(specs, "member", key="model"):
        if "model" in params:
            raise EnsembleInputError(f"member {name!r}: the model is the spec's name; "
                                     "drop model=")
        out.append({"model": name, **params})
    if not out:
        raise EnsembleInputError("no members: set config.members")
    return out


MEMBER_FIELDS = ("weight", "prefix", "chat", "template", "name")


def check_model_source(source: str) -> None:
    """Refuses a model source that is neither a registered name, an existing file or
    directory, nor ``random:<tokenizer source>[:seed]`` (checked before any model
    loads; ``brf.checkpoints.registry.resolve`` would assemble a registered GGUF)."""
    from brf.checkpoints.registry import MODELS, ModelSourceError
    import os
    if source.startswith("random:"):  # a tiny random model (_random_model)
        parts = source.split(":")
        if len(parts) not in (2, 3) or not parts[1] or (len(parts) == 3
                                                        and not parts[2].isdigit()):
            raise EnsembleInputError(f"model {source!r}: write random:<tokenizer source> or "
                                     "random:<tokenizer source>:<seed>")
        check_model_source(parts[1])
        return
    if source in MODELS or os.path.exists(os.path.expanduser(source)):
        return
    raise ModelSourceError(f"{source!r} is neither a model name ({', '.join(MODELS.names())}) "
                           "nor an existing .gguf file or directory")


def check_member_specs(specs: str | Sequence[Any]) -> list[dict]:
    """:func:`member_specs`, each member's fields checked (before any model loads):
    only ``weight`` (a finite number >= 0), ``prefix`` (text), ``chat`` (True or
    False), ``template`` (a format string with ``{prompt}``, not with chat=True) and
    ``name`` (text); the model a known source."""
    out = member_specs(specs)
    for spec in out:
        src = spec["model"]
        unknown = sorted(set(spec) - {"model", *MEMBER_FIELDS})
        if unknown:
            raise EnsembleInputError(f"member {src!r}: unknown field(s) {unknown}; a member "
                                     f"takes {list(MEMBER_FIELDS)}")
        w = spec.get("weight")
        if w is not None:
            S.number(0).validate(w, f"member {src!r}: weight")
        for key in ("prefix", "name"):
            if key in spec and not isinstance(spec[key], str):
                raise EnsembleInputError(f"member {src!r}: {key} must be a string (quoted); "
                                         f"got {spec[key]!r}")
        if "chat" in spec and not isinstance(spec["chat"], bool):
            raise EnsembleInputError(f"member {src!r}: chat must be True or False; got "
                                     f"{spec['chat']!r}")
        if spec.get("template") is not None:
            check_template(spec["template"], f"member {src!r}: template")
            if spec.get("chat"):
                raise EnsembleInputError(f"member {src!r}: give chat=True or a template, "
                                         "not both")
        check_model_source(src)
    return out


def _tokenizer_only(source: str):
    """A member source's tokenizer without its weights (a GGUF's metadata, a
    directory's tokenizer files, a cached checkpoint's); None when it has none."""
    from brf.checkpoints import registry, store
    from brf.checkpoints.tokenizer import load_tokenizer
    import os
    if source.startswith("random:"):
        return _tokenizer_only(source.split(":")[1])
    if os.path.isdir(source) and store.is_checkpoint(source):
        path = os.path.join(source, "tokenizer")
    elif registry.converted(source):
        path = os.path.join(registry.cache_path(source), "tokenizer")
    else:
        path = None
    try:
        if path is None:
            path = registry.resolve(source)
        return load_tokenizer(path)
    except FileNotFoundError:  # no such source, or no tokenizer files: `load_members` says so
        return None


def check_fusable(specs: str | Sequence[Any], *, aligner: str = "auto",
                  level: str = "tokens", reencode: bool = True) -> None:
    """Refuses a member brf cannot fuse *before* any model is converted into the cache.

    Across vocabularies (level 'bytes', an aligner other than 'identity', or 'auto'
    with members of different vocabularies) every member's tokenizer must read as
    bytes (`brf.align.token_table`: a known decoder) and, at level 'bytes' or with
    ``reencode`` (what generation needs; scoring a fixed text on co-aligned tokens
    does not), re-encode text in the middle of a generation
    (`brf.align.reencode.check_reencodable`). Only the tokenizers are read, and only
    when some member is not converted yet (a converted one loads in seconds and is
    checked as it loads).

    Raises:
        EnsembleInputError: naming the member and what it cannot do.
    """
    from brf import align
    from brf.align.reencode import check_reencodable
    from brf.checkpoints import registry
    sources = list(dict.fromkeys(s["model"] for s in member_specs(specs)))
    if (level == "tokens" and aligner == "identity") or all(
            s.startswith("random:") or registry.converted(s) for s in sources):
        return
    toks = {s: t for s in sources if (t := _tokenizer_only(s)) is not None}
    codecs, vocabs = {}, set()
    for s, tok in toks.items():
        try:
            codecs[s] = align.make_codec(tok)
            vocabs.add(codecs[s].table.digest)
        except ValueError as e:
            codecs[s] = e
            vocabs.add(hash(tuple(sorted(tok.get_vocab().items()))))
    if level == "tokens" and aligner == "auto" and len(vocabs) <= 1:
        return  # one vocabulary: 'auto' picks 'identity'
    for s, c in codecs.items():
        try:
            if isinstance(c, Exception):
                raise c
            if reencode or level == "bytes":
                check_reencodable(c, f"{s!r}'s tokenizer")
        except ValueError as e:
            raise EnsembleInputError(f"member {s!r} cannot be fused across vocabularies: {e} "
                                     "(refused before converting it into the cache)") from None


def load_members(specs: str | Sequence[Any], dtype=None, mesh=None) -> list[Member]:
    """Members from config specs; each distinct model is loaded once and shared.

    Args:
        specs: see :func:`member_specs`. Each names a 'model' (a brf.checkpoints
            source: registered name, .gguf, HF dir or brf checkpoint; or
            'random:<tokenizer source>[:seed]' for a tiny random model), with
            optional 'name', 'weight', 'prefix', 'chat', 'template' (see
            :class:`brf.ensemble.member.Member`).
        dtype: parameter dtype (default float32).
        mesh: None; a mesh; or one per member (:func:`brf.sharding.member_meshes`):
            each model is read straight onto the mesh of the first member that
            uses it, split over its 'model' axis (``registry.load(mesh=)``).

    Returns:
        The members, in order.
    """
    specs = member_specs(specs)
    meshes = sharding.per_member(mesh, len(specs))
    loaded: dict[str, tuple] = {}
    members = []
    for j, spec in enumerate(specs):
        spec = dict(spec)
        source = spec.pop("model")
        if source not in loaded:
            if source.startswith("random:"):
                loaded[source] = _random_model(source)
            else:
                from brf.checkpoints import registry
                m = registry.load(source, dtype=dtype, mesh=meshes[j])  # bars only if converted
                if m.tokenizer is None:
                    raise EnsembleInputError(f"model {source!r} has no tokenizer")
                loaded[source] = (m.cfg, m.params, m.tokenizer)
        cfg, params, tok = loaded[source]
        name = spec.pop("name", None) or (source if sum(
            s["model"] == source for s in specs) == 1 else f"{source}#{j}")
        unknown = set(spec) - {"weight", "prefix", "chat", "template"}
        if unknown:
            raise EnsembleInputError(f"member {name!r}: unknown fields {sorted(unknown)}")
        members.append(Member(name=name, cfg=cfg, params=params, tokenizer=tok, **spec))
    return members


def auto_aligner(members: Sequence[Member]) -> str:
    """'identity' when every member shares member 0's vocabulary, else 'union'."""
    return "identity" if all(same_vocabulary(members[0], m) for m in members) else "union"


def read_prompts(prompts: Iterable[str] | str, prompts_file: str = "", *,
                 lines: bool = False) -> list[str]:
    """The prompts: those of a file if one is named (one a line, or JSONL with a
    'prompt' field), which replace ``prompts``; else ``prompts``, every one of them.
    Every prompt is checked by the one rule (`brf.ensemble.member.check_prompts`):
    nothing is skipped, so prompt i is output row i.

    Args:
        prompts: the config's prompts: a sequence of strings (one string: one prompt).
        prompts_file: a file that replaces them ('' for none).
        lines: ``prompts`` is one string with a prompt a line (dump_logits').

    Raises:
        EnsembleInputError: no prompts (a prompts file without any is an error of
            its own), a prompt that breaks the rule (empty or blank, not a string,
            not valid UTF-8 text; named by its number or line), a file that cannot
            be read, or a bad JSON line.
    """
    if not prompts_file:
        if lines:
            return prompt_lines(str(prompts), "config.prompts")
        return check_prompts(prompts, "config.prompts")
    try:
        with open(prompts_file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise EnsembleInputError(f"cannot read config.prompts_file {prompts_file}: "
                                 f"{getattr(e, 'strerror', None) or e}") from None
    return prompt_lines(text, f"config.prompts_file {prompts_file}")


def aligner_params(aligner: str, params) -> dict | None:
    """The entries of ``params`` that aligner declares (configs keep e.g. k=16 always)."""
    if aligner == "identity" or not params:
        return None
    from brf.align import ALIGNERS
    declared = ALIGNERS.get(aligner.removeprefix("align:")).params
    return {k: v for k, v in dict(params).items() if k in declared} or None


def method_spec(method: str, method_params: Mapping[str, Any] | None = None,
                phase: str = "") -> tuple[str, dict]:
    """The config's method: a spec string such as ``loglinear(temperature=0.8)``, merged
    with ``method_params`` and ``phase`` (the latter only for methods that take a phase
    map); a parameter given twice is refused."""
    from brf.fusion import get_method
    name, params = parse_spec(method, "method")
    takes_phase = "phase" in get_method(name).params
    given = [(k, v, "config.method_params") for k, v in dict(method_params or {}).items()]
    if phase and takes_phase:
        given.append(("phase", phase, "config.phase"))
    for key, value, where in given:
        if key in params:
            hint = " (set config.phase='' to use the method's)" if where == "config.phase" else ""
            raise EnsembleInputError(f"method parameter {key!r} is given twice: in "
                                     f"config.method {method!r} and in {where}{hint}")
        params[key] = value
    return name, params


def check_mixture_method(mode: str, method: str, method_params: Mapping[str, Any],
                         given: str = "", given_params: Mapping[str, Any] | None = None
                         ) -> None:
    """Refuses a fusion method in the mixture modes, where it would mean nothing.

    ``mixture_exact`` and ``mixture_per_member`` draw one member per step from the
    members' linear pool, so the method must stay ``'linear'`` there (as in
    configs/generate.py:me) without parameters; ``config.phase`` is not read by it.
    ``given`` / ``given_params``: the config's ``method`` and ``method_params`` as
    written (named in the error).
    """
    from brf.ensemble.decode import MODES
    if mode == "fuse" or mode not in MODES:  # an unknown mode is refused by its checks
        return
    if method == "linear" and not method_params:
        return
    key, value = "config.method", given or method
    if method == "linear" and not parse_spec(given or method, "method")[1]:
        key, value = "config.method_params", dict(given_params or {})
    raise EnsembleInputError(f"{key}={value!r} is not used in mode {mode!r}: mixture "
                             "sampling draws one member per step from the members' linear "
                             "pool; set config.method='linear' without parameters (as "
                             "configs/generate.py:me does) or mode='fuse'")


def weighting_spec(weighting: str) -> float | None:
    """'' (the members' weights) -> None; 'perplexity[(temperature=t)]' -> t."""
    if not weighting:
        return None
    name, params = parse_spec(weighting, "weighting")
    if name != "perplexity" or set(params) - {"temperature"}:
        raise EnsembleInputError(f"unknown weighting {weighting!r}; use '' (the members' "
                                 "weights) or 'perplexity(temperature=1.0)' (PackLLM)")
    t = params.get("temperature", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
        raise EnsembleInputError(f"weighting {weighting!r}: temperature must be > 0 and "
                                 "finite")
    return float(t)


def place_members(members: Sequence[Member], mesh) -> list[Member]:
    """Members with their weights split over a mesh's 'model' axis (``brf.sharding``).

    Args:
      members: the ensemble.
      mesh: one mesh for every member, or one per member
        (:func:`brf.sharding.member_meshes`, placement 'apart': each member on
        its own devices). None, or one mesh of one device: the members unchanged.

    Members that share a model and a mesh keep sharing one placed copy.
    """
    meshes = sharding.per_member(mesh, len(members))
    if sharding.on_one_device(meshes):
        return list(members)
    placed: dict[tuple, Any] = {}
    out = []
    for m, x in zip(members, meshes):
        key = (id(m.params), None if x is None else sharding.mesh_devices(x))
        if key not in placed:
            placed[key] = sharding.shard_params(m.params, x)
        out.append(dataclasses.replace(m, params=placed[key]))
    return out


LEVELS = ("tokens", "bytes")
DTYPES = ("float32", "bfloat16", "float16")  # the members' compute dtypes


def check_method_params(name: str, params: Mapping[str, Any]) -> None:
    """A registered method and its parameters by name and value (arrays, such as the
    bottleneck's unembeddings, come from the members and are not checked here)."""
    from brf.fusion import get_method
    from brf.fusion.methods import resolve_params
    m = get_method(name)
    declared = {k: p for k, p in m.params.items() if p.kind != "array"}
    try:
        resolve_params(dataclasses.replace(m, params=declared),
                       {k: v for k, v in params.items()
                        if k not in set(m.params) - set(declared)})
    except UserError:
        raise
    except (TypeError, ValueError) as e:  # a value of the wrong kind (int('x'), int([1]))
        raise EnsembleInputError(f"method {name!r}: a parameter of the wrong kind in "
                                 f"{params}: {e}") from None


def _method_check(value: str) -> None:
    check_method_params(*parse_spec(value, "method"))


def _phase_check(value: str) -> None:
    if value:
        from brf.fusion import phase_map
        phase_map(value)


def _aligner_check(value: str) -> None:
    from brf.align import ALIGNERS
    if value != "auto" and value.removeprefix("align:") not in ALIGNERS:
        raise EnsembleInputError(f"unknown vocabulary aligner {value!r}; use 'auto' (identity "
                                 f"for one vocabulary, else union) or one of "
                                 f"{', '.join(ALIGNERS.names())}")


def _sampler_check(value: str) -> None:
    from brf.fusion import Sampler
    Sampler.parse(value)


def _drafter_check(value: str) -> None:
    from brf.drafting import parse_drafter
    parse_drafter(value)


def check_file(value: str) -> None:
    """A file the config names ('' for none) exists and is a file."""
    import os
    if value and not os.path.isfile(value):
        raise EnsembleInputError("no such file" if not os.path.exists(value)
                                 else "not a file (a directory?)")


def _stop_check(value) -> None:
    for i, s in enumerate(value, 1):
        if not s:
            raise EnsembleInputError(f"config.stop: stop string {i} is empty (it would stop "
                                     "before the first token)")


def _mesh_axis():
    return S.integer(1, S.DEVICES_MAX, special=(-1,),
                     note="-1: every device the other axis leaves")


# configs/generate.py, every key (brf.schema): checked by Request.from_config before
# any model loads.
SCHEMA = {
    "members": S.text(empty=False, check=check_member_specs),
    "aligner": S.text(check=_aligner_check),
    "aligner_params.k": S.integer(1, 2**18),
    "mode": S.text(choices=MODES),
    "method": S.text(empty=False, check=_method_check),
    "phase": S.text(check=_phase_check, note="'': the method's default"),
    "method_params": S.mapping(),
    "weighting": S.text(check=weighting_spec),
    "sampler": S.text(check=_sampler_check),
    "choice": S.text(choices=CHOICES),
    "max_new_tokens": S.integer(1, 10**6),
    "stop": S.texts(check=_stop_check),
    "seed": S.seed(),
    "dtype": S.text(choices=DTYPES),
    "prompts": S.texts(),
    "prompts_file": S.text(check=check_file),
    "output": S.text(),
    "stream": S.flag(),
    "compilation_cache": S.flag(),
    "level": S.text(choices=LEVELS),
    "speculative": S.text(check=_drafter_check),
    "engine": S.text(choices=ENGINES),
    "beam": S.integer(1, 2**16),
    "threshold": S.number(0, 1, high_open=True),
    "max_new_bytes": S.integer(1, 10**6),
    "utf8": S.flag(),
    "check_precision": S.flag(),
    "mesh.data": _mesh_axis(),
    "mesh.model": _mesh_axis(),
    "mesh.placement": S.text(choices=sharding.PLACEMENTS),
}


def check_config(c) -> None:
    """Every key of a generation config against :data:`SCHEMA` (types, ranges, names).

    Raises:
        EnsembleInputError: the first key that is wrong, named.
    """
    S.check(c, SCHEMA, error=EnsembleInputError)


def _check_phase_offsets(method: str, params: Mapping[str, Any], c, n_members: int) -> None:
    """A phase map with one offset per member must have as many as config.members."""
    if "phase" not in params:
        return
    from brf.fusion import phase_map
    offset = np.asarray(phase_map(params["phase"]).params["offset"])
    if offset.ndim == 0 or offset.shape[0] == n_members:
        return
    in_method = "phase" in parse_spec(c.method, "method")[1]
    where, given = ("config.method", c.method) if in_method else ("config.phase", c.phase)
    hint = (" With one member every method gives that member's distribution; set "
            "--config.phase='' (the method's default map) for plain decoding."
            if n_members == 1 else f" Give {n_members} offsets or one for all.")
    raise EnsembleInputError(f"{where}={given!r} gives {offset.shape[0]} phase offsets (one "
                             f"per member) but config.members names {n_members} "
                             f"member{'s' if n_members != 1 else ''}.{hint}")


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation run, read from a config (configs/generate.py) and checked once,
    before any model loads (:meth:`from_config`).

    Attributes:
      level: 'tokens' (fused next-token distributions) or 'bytes' (fused next-byte
        distributions, :mod:`brf.bytes.generate`).
      members: member specs (:func:`member_specs`).
      prompts: the prompts (``prompts``, or ``prompts_file`` when it is set).
      mode, method, method_params, sampler, stop, seed, dtype: as configured, the
        method's spec and ``phase`` folded into ``method`` / ``method_params``.
      max_new: the most new tokens (tokens) or bytes (bytes) per prompt.
      aligner, aligner_params, choice, weighting, temperature, mesh: the token level's
        (``temperature``: the PackLLM weighting's, None for the members' weights).
      beam, threshold, utf8, check_precision: the byte level's.
      speculative: the drafter of speculative fused decoding (`brf.drafting.DraftSpec`;
        None: plain fused decoding), on either level.
      engine: where the token level's steps run ('auto', 'host', 'device').
    """
    level: str
    members: tuple
    prompts: tuple[str, ...]
    mode: str
    method: str
    method_params: Mapping[str, Any]
    sampler: str
    stop: tuple[str, ...]
    seed: int
    dtype: Any
    max_new: int
    aligner: str = "auto"
    aligner_params: Mapping[str, Any] | None = None
    choice: str = "per_sequence"
    weighting: str = ""
    temperature: float | None = None
    mesh: Any = None
    beam: int = 0
    threshold: float = 0.0
    utf8: bool = True
    check_precision: bool = False
    speculative: Any = None
    engine: str = "auto"

    @classmethod
    def from_config(cls, c) -> "Request":
        """The request a config asks for; a UserError names what cannot be honoured."""
        check_config(c)
        level = c.level
        specs = tuple(member_specs(c.members))
        method, params = method_spec(c.method, c.method_params, c.phase)
        check_mixture_method(c.mode, method, params, c.method, c.method_params)
        try:  # config.method_params and config.phase joined to the method's own
            check_method_params(method, params)
        except UserError as e:
            raise EnsembleInputError(f"config.method={c.method!r} with config.method_params="
                                     f"{dict(c.method_params)} and config.phase={c.phase!r}: "
                                     f"{e}") from None
        if c.mode == "fuse":
            _check_phase_offsets(method, params, c, len(specs))
        from brf.drafting import parse_drafter
        drafter = parse_drafter(c.speculative)
        if drafter is not None:
            from brf.ensemble.speculative import check_mode
            check_mode(c.mode)
        common = dict(level=level, members=specs, mode=c.mode, method=method,
                      method_params=params, sampler=c.sampler, stop=tuple(c.stop),
                      seed=c.seed, dtype=jnp.dtype(c.dtype), speculative=drafter,
                      prompts=tuple(read_prompts(c.prompts, c.prompts_file)))
        engine = c.get("engine", "auto")  # configs written before it: 'auto'
        if level == "tokens":
            return cls(**common, max_new=c.max_new_tokens, aligner=c.aligner,
                       aligner_params=dict(c.aligner_params), choice=c.choice,
                       weighting=c.weighting, temperature=weighting_spec(c.weighting),
                       mesh=c.mesh, engine=engine)
        if engine != "auto":
            raise EnsembleInputError(f"config.engine={engine!r} is token-level only (the "
                                     "byte level runs its own loop); set it to 'auto' with "
                                     "level='bytes'")
        from brf.bytes.generate import check_request
        from brf.fusion import Sampler
        check_request(mode=c.mode, method=method, method_params=params,
                      sampler=Sampler.parse(c.sampler), beam=c.beam, threshold=c.threshold,
                      max_bytes=c.max_new_bytes)
        if c.weighting:
            raise EnsembleInputError("config.weighting is token-level only; set it to '' "
                                     "with level='bytes'")
        return cls(**common, max_new=c.max_new_bytes, beam=c.beam, threshold=c.threshold,
                   utf8=c.utf8, check_precision=c.check_precision)


def run(request, on_piece: Callable[[Piece], None] | None = None) -> list[dict]:
    """Generates what ``request`` asks for (a :class:`Request`, or a configs/generate.py
    config, read by :meth:`Request.from_config`); returns one JSON-ready row per prompt.

    Tokens: with ``weighting = 'perplexity(...)'`` every prompt gets its own PackLLM
    weights (:mod:`brf.ensemble.packllm`), so prompts are generated one at a time.
    ``mesh`` (optional): the members' weights are split over its 'model' axis
    (tensor-parallel decoding), the prompts over 'data'; with ``placement='apart'``
    each member gets its own devices and the members run at the same time (see
    :mod:`brf.sharding`). Bytes: :func:`_run_bytes`.
    """
    req = request if isinstance(request, Request) else Request.from_config(request)
    return (_run_bytes if req.level == "bytes" else _run_tokens)(req, on_piece)


def _run_tokens(req: Request, on_piece: Callable[[Piece], None] | None) -> list[dict]:
    meshes = None
    if req.mesh:
        meshes = sharding.member_meshes(req.mesh, len(req.members))
        if sharding.on_one_device(meshes):
            meshes = None  # one device
    check_fusable(req.members, aligner=req.aligner)
    members = place_members(load_members(req.members, mesh=meshes), meshes)
    prompts = list(req.prompts)
    aligner = req.aligner if req.aligner != "auto" else auto_aligner(members)
    generate_fn = generate
    if req.speculative is not None:  # the same law as plain fused decoding, its own loop
        from brf.ensemble.speculative import check_speculative, speculative_generate
        check_speculative(members, req.speculative)
        generate_fn = functools.partial(speculative_generate, drafter=req.speculative)
    weights = [m.get("weight") for m in req.members]
    weights = None if all(w is None for w in weights) else weights
    fuse = req.mode == "fuse"
    kwargs = dict(mode=req.mode, method=req.method,
                  method_params=req.method_params if fuse else None,
                  sampler=req.sampler, max_new_tokens=req.max_new, stop=req.stop,
                  seed=req.seed, aligner=aligner,
                  aligner_params=aligner_params(aligner, req.aligner_params),
                  choice=req.choice, dtype=req.dtype, engine=req.engine)
    t0 = time.perf_counter()
    nll = None
    if req.temperature is None:
        gens: list[Generation] = generate_fn(members, prompts, weights=weights,
                                             on_piece=on_piece, **kwargs)
        weights_B = [[m.weight for m in members]] * len(prompts)
    else:
        from brf.ensemble.packllm import perplexity_weight_table
        w_Bxn, nll = perplexity_weight_table(members, prompts, req.temperature)
        gens, weights_B = [], w_Bxn.tolist()
        for b, p in enumerate(prompts):
            relay = None if on_piece is None else (
                lambda piece, b=b: on_piece(dataclasses.replace(piece, index=b)))
            gens += generate_fn(members, [p], weights=w_Bxn[b], on_piece=relay, **kwargs)
    seconds = time.perf_counter() - t0
    rows = []
    for b, g in enumerate(gens):
        row = dict(prompt=g.prompt, text=g.text, finish_reason=g.finish_reason,
                   n_events=g.n_events, members=[m.name for m in members],
                   members_run=g.members_run, mode=req.mode, aligner=aligner,
                   **_method_fields(req), weights=weights_B[b], sampler=req.sampler,
                   seed=req.seed, seconds_batch=round(seconds, 3))
        if req.speculative is not None:
            row["speculative"] = dict(g.spec.summary(), engine=g.engine)
        if nll is not None:
            row["weighting"] = req.weighting
            row["prompt_nll"] = [round(float(x), 4) for x in nll[b]]
        rows.append(row)
    return rows


def _method_fields(req: Request) -> dict:
    fuse = req.mode == "fuse"
    return dict(method=req.method if fuse else None,
                method_params={k: str(v) for k, v in req.method_params.items()} if fuse else {})


def _run_bytes(req: Request, on_piece: Callable[[Piece], None] | None) -> list[dict]:
    """The byte level: the members' next-byte distributions fused and sampled byte by
    byte (:mod:`brf.bytes.generate`), one prompt at a time.

    Each member conditions on its own prompt tokens (prefix, chat template);
    the generated text is read by every member as bytes.
    """
    from brf.bytes import REFERENCE, Settings
    from brf.bytes.generate import generate_bytes, measure_precision
    from brf.bytes.lm import ByteLM
    from brf.align.union import default_cache_dir
    from brf.fusion import Sampler

    check_fusable(req.members, level="bytes")
    members = load_members(req.members)
    views: dict[int, ByteLM] = {}
    for m in members:
        if id(m.params) not in views:
            views[id(m.params)] = ByteLM(m.params, m.cfg, m.tokenizer, name=m.name,
                                         dtype=req.dtype, cache_dir=default_cache_dir())
    lms = [views[id(m.params)] for m in members]
    weights = [m.weight for m in members]
    weights = None if all(w is None for w in weights) else weights
    sampler = Sampler.parse(req.sampler)
    rows = []
    for b, prompt in enumerate(req.prompts):
        relay = None if on_piece is None else (
            lambda piece, b=b: on_piece(Piece(b, piece.text, piece.finished)))
        t0 = time.perf_counter()
        contexts = [m.prompt_ids(prompt) for m in members]
        kwargs = dict(weights=weights, method=req.method, method_params=req.method_params,
                      sampler=sampler, max_bytes=req.max_new, stop=req.stop, seed=req.seed,
                      beam=req.beam, threshold=req.threshold, utf8=req.utf8,
                      eos_ids=[sorted(m.eos_ids()) for m in members], on_piece=relay,
                      trace=req.check_precision)
        if req.speculative is None:
            g = generate_bytes(lms, contexts, mode=req.mode, **kwargs)
        else:  # n-gram drafts may copy from the prompt's bytes
            from brf.bytes.speculative import generate_bytes_speculative
            g = generate_bytes_speculative(lms, contexts, drafter=req.speculative,
                                           lookup=prompt.encode("utf-8"), **kwargs)
        seconds = time.perf_counter() - t0
        precision = None
        if req.check_precision:
            precision = dict(reference=REFERENCE.as_dict(),
                             members=[dict(member=m.name, **got) for m, got in
                                      zip(members, measure_precision(
                                          lms, contexts, g, reference=REFERENCE))])
        rows.append(dict(prompt=prompt, text=g.text, finish_reason=g.finish_reason,
                         n_bytes=len(g.data), members=[m.name for m in members],
                         level="bytes", mode=req.mode, **_method_fields(req),
                         weights=weights, sampler=req.sampler, seed=req.seed, beam=req.beam,
                         threshold=req.threshold, tokens_run=g.tokens,
                         max_hypotheses=[max(h, default=0) for h in g.n_hyp],
                         lost=[round(float(-np.log1p(-np.minimum(p, 1 - 1e-16)).sum()), 6)
                               for p in map(np.asarray, g.pruned)],
                         settings=Settings(req.beam, req.threshold, 0).as_dict(),
                         precision=precision, seconds=round(seconds, 3)))
        if req.speculative is not None:
            rows[-1]["speculative"] = g.spec.summary()
    return rows


def precision_line(row: Mapping[str, Any]) -> str:
    """What a byte-level generation's member views rest on, in one line: the
    settings, the pruned log-mass (one-sided) and, when measured, the distance from
    the reference."""
    s = row["settings"]
    head = (f"byte level at beam {s['beam']}, threshold {s['threshold']:g}, no merging: "
            "pruned log-mass " + ", ".join(f"{n} {x:.3g}" for n, x in
                                           zip(row["members"], row["lost"]))
            + " nats (each member's kept mass is a lower bound of its probability of the text)")
    p = row.get("precision")
    if not p:
        return head + "; precision against the reference not measured (check_precision=True)"
    r = p["reference"]
    parts = [f"{m['member']} total variation mean {m['tv_mean']:.2g}, p99 {m['tv_p99']:.2g}, "
             f"bits/byte {m['dbpb']:+.2g}" for m in p["members"] if "tv_mean" in m]
    return (head + f"; against beam {r['beam']}, threshold {r['threshold']:g}: "
            + ("; ".join(parts) or "nothing generated"))


def speculative_line(summary: Mapping[str, Any], index: int | None = None) -> str:
    """A row's acceptance statistics (``row['speculative']``) in one line."""
    unit = summary["unit"]
    tag = "" if index is None else f"[{index}] "
    acc = summary["acceptance"]
    return (f"{tag}speculative {summary['drafter']}: {summary['rounds']} rounds, "
            f"{summary['drafted']} {unit} drafted, {summary['accepted']} accepted "
            f"(acceptance {'-' if acc is None else f'{acc:.2f}'}), "
            f"{summary['per_round'] or 0:.2f} {unit} per round"
            + (f", {summary['paused']} paused (drafting did not pay)"
               if summary.get("paused") else "")
            + (f"; rounds on the {summary['engine']}" if summary.get("engine") else ""))


def print_texts(rows: Sequence[Mapping[str, Any]], out=None) -> None:
    """Each prompt and its generated text, assembled (what generate.py prints by
    default): a header line with the prompt, the text as generated, and why it
    ended, a blank line between prompts."""
    out = out or sys.stdout
    n = len(rows)
    for b, row in enumerate(rows):
        unit = "bytes" if row.get("level") == "bytes" else "tokens"
        count = row.get("n_bytes") if unit == "bytes" else row.get("n_events")
        tag = f"[{b + 1}/{n}] " if n > 1 else ""
        if b:
            out.write("\n")
        out.write(f"{tag}prompt: {row['prompt']}\n")
        out.write(row["text"] + "\n")
        out.write(f"[{row['finish_reason']}: {count} {unit}]\n")
    out.flush()


def print_stream(piece: Piece, n_prompts: int) -> None:
    """A streaming printer: text as it comes for one prompt, tagged pieces for several."""
    if n_prompts == 1:
        sys.stdout.write(piece.text)
        if piece.finished:
            sys.stdout.write(f"\n[{piece.finished}]\n")
    elif piece.text or piece.finished:
        sys.stdout.write(f"[{piece.index}] {piece.text!r}"
                         + (f" [{piece.finished}]" if piece.finished else "") + "\n")
    sys.stdout.flush()
