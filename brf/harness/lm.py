"""The harness model: :class:`BRFLM`, registered as ``brf`` in lm_eval's model registry
when this module is imported (it imports lm_eval; brf.harness's docstring has the model
args)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from brf.align.vocab import encode_text
from brf.errors import UserError
from brf.harness import calibrated
from brf.harness.ensemble import ByteReport, Ensemble, HarnessInputError

NAME = "brf"
LEVELS = ("auto", "tokens", "bytes")
KEYS = ("members", "method", "phase", "level", "precision", "beam", "threshold",
        "batch_size", "max_length", "max_gen_toks", "max_gen_bytes", "seed", "dtype",
        "speculative", "study")
# What the harness passes to every model whatever the user wrote (not used here).
HARNESS_KEYS = ("device", "max_batch_size")


def commas(text: str) -> str:
    """``;`` outside quoted strings read as ``,`` (model args survive the harness's
    comma splitting that way)."""
    out, quote = [], None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == ";":
            ch = ","
        out.append(ch)
    return "".join(out)


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    """The model args, checked (:meth:`parse`) before any model loads."""
    members: Any
    method: str = "linear"
    phase: str = ""
    level: str = "auto"
    precision: str = "default"
    beam: int | None = None
    threshold: float | None = None
    batch_size: int = 8
    max_length: int | None = None
    max_gen_toks: int = 256
    max_gen_bytes: int | None = None
    seed: int = 0
    dtype: str = "float32"
    speculative: str = ""
    study: str = ""

    @classmethod
    def parse(cls, args: Mapping[str, Any]) -> "ModelArgs":
        """Model args as the harness hands them over (strings, or numbers it cast).

        Raises:
            HarnessInputError: an unknown key, a bad value, a bad spec (named).
        """
        from brf.bytes import PRESETS
        from brf.ensemble.run import (DTYPES, check_member_specs, check_method_params,
                                      method_spec)
        args = {k: v for k, v in dict(args).items() if k not in HARNESS_KEYS}
        unknown = sorted(set(args) - set(KEYS))
        if unknown:
            raise HarnessInputError(f"unknown model arg(s) {unknown}; brf takes {list(KEYS)}")
        if "members" not in args:
            raise HarnessInputError("model args need members=... (brf member specs, ';' for "
                                    "',': members=a(weight=0.5); b(weight=0.5))")
        if args.get("batch_size") in ("auto", None):  # the harness's default
            args.pop("batch_size", None)
        for key in ("members", "method", "phase", "speculative", "study"):
            if key in args and isinstance(args[key], str):
                args[key] = commas(args[key])
        a = cls(**args)
        if isinstance(a.members, str):
            check_member_specs(a.members)
        for key, choices in (("level", LEVELS), ("precision", tuple(PRESETS)),
                             ("dtype", DTYPES)):
            if getattr(a, key) not in choices:
                raise HarnessInputError(f"model arg {key}={getattr(a, key)!r}; use one of "
                                        f"{', '.join(choices)}")
        for key, low in (("batch_size", 1), ("max_gen_toks", 1), ("seed", 0),
                         ("max_length", 2), ("max_gen_bytes", 1), ("beam", 1)):
            v = getattr(a, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise HarnessInputError(f"model arg {key}={v!r}; give an integer >= {low}")
        t = a.threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0 <= t < 1):
            raise HarnessInputError(f"model arg threshold={t!r}; give a number in [0, 1)")
        name, params = method_spec(a.method, {}, a.phase)
        check_method_params(name, params)
        a.drafter()
        if a.study:
            if "method" in args or a.phase:
                raise HarnessInputError("model arg study=... is the method (its fitted row, "
                                        "weights included): give no method or phase with it")
            calibrated.study_row(a.study)
        return a

    def drafter(self):
        """The speculative drafter (`brf.drafting.DraftSpec`), or None (off)."""
        from brf.drafting import parse_drafter
        if not isinstance(self.speculative, str):
            raise HarnessInputError(f"model arg speculative={self.speculative!r}; give a "
                                    "drafter spec such as ngram(n=3; k=6), or '' for none")
        try:
            return parse_drafter(self.speculative)
        except UserError as e:
            raise HarnessInputError(f"model arg speculative={self.speculative!r}: {e}") from None

    def settings(self) -> tuple[int, float]:
        """(beam, threshold) of the byte level: the preset, with beam / threshold over it."""
        from brf.bytes import PRESETS
        p = PRESETS[self.precision]
        return (p.beam if self.beam is None else self.beam,
                p.threshold if self.threshold is None else float(self.threshold))


@register_model(NAME)
class BRFLM(LM):
    """A brf ensemble as a harness model (``--model brf``); see the module docstring.

    Args:
        members: member specs (a string, ``;`` for ``,``) or loaded
            `brf.ensemble.member.Member` objects (members loaded once, several models).
        byte_cache: a dict shared by models of the same loaded members: each member's
            byte-level scores of a request are computed once (`Ensemble`).
        **kwargs: the other model args (module docstring).

    Attributes:
        byte_reports: per byte-level request answered, its `ByteReport` (the pruned
            log-mass per member), in the order answered.
    """

    def __init__(self, members, byte_cache: dict | None = None, **kwargs):
        super().__init__()
        a = ModelArgs.parse(dict(kwargs, members=members))
        from brf.ensemble.run import check_fusable, load_members, method_spec
        from brf.ensemble.member import same_vocabulary
        self.args = a
        if isinstance(a.members, str):  # a member brf cannot fuse: before it converts
            check_fusable(a.members, level="bytes" if a.level == "bytes" else "tokens")
            mems = load_members(a.members)
        else:
            mems = list(a.members)
        shared = all(same_vocabulary(mems[0], m) for m in mems)
        level = a.level if a.level != "auto" else ("tokens" if shared else "bytes")
        if level == "tokens" and not shared:
            raise HarnessInputError("level=tokens needs members that share one vocabulary; "
                                    "use level=bytes (or auto) across tokenizers")
        method, params = method_spec(a.method, {}, a.phase)
        weights = None
        self.study = calibrated.study_row(a.study) if a.study else None
        if self.study is not None:
            names = tuple(m.name for m in mems)
            if names != self.study.members:
                raise HarnessInputError(f"study={a.study!r} was fitted on members "
                                        f"{list(self.study.members)}; these are {list(names)}")
            if level != "bytes":
                raise HarnessInputError(f"study={a.study!r}: its rows are fitted per byte; "
                                        "use level=bytes (or auto)")
            method, params, weights = self.study.method, self.study.params, self.study.weights
        beam, threshold = a.settings()
        longest = min(m.cfg.max_seq_len for m in mems)
        self.ensemble = Ensemble(mems, method, params, level=level, beam=beam,
                                 threshold=threshold, batch_size=a.batch_size,
                                 max_length=min(a.max_length or longest, longest),
                                 dtype=a.dtype, drafter=a.drafter(), weights=weights,
                                 byte_cache=byte_cache)
        self.byte_reports: list[ByteReport] = []

    @property
    def level(self) -> str:
        return self.ensemble.level

    @property
    def max_length(self) -> int:
        return self.ensemble.max_length

    @property
    def tokenizer_name(self) -> str:
        return "+".join(m.name for m in self.ensemble.members)

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        pairs = [tuple(r.args) for r in requests]
        bar = tqdm(total=len(pairs), desc=f"brf loglikelihood ({self.level})",
                   disable=disable_tqdm)
        if self.level == "tokens":
            out = self.ensemble.score_tokens(self.ensemble.token_requests(pairs), bar)
        else:
            got = self.ensemble.score_bytes(pairs, bar)
            self.byte_reports += [g[2] for g in got]
            out = [(g[0], g[1]) for g in got]
        bar.close()
        for pair, ans in zip(pairs, out):
            self.cache_hook.add_partial("loglikelihood", pair, ans)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        e = self.ensemble
        bad = [m.name for m in e.members if m.prefix or m.chat or m.template is not None]
        if bad:
            raise HarnessInputError(f"members {bad} have a prefix, chat or template; a "
                                    "perplexity task scores the raw text (drop them)")
        docs = [r.args[0] for r in requests]
        bar = tqdm(total=len(docs), desc=f"brf loglikelihood_rolling ({self.level})",
                   disable=disable_tqdm)
        if self.level == "bytes":
            out = []
            for d in docs:
                lp, report = e.rolling_bytes(d)
                out.append(lp)
                self.byte_reports.append(report)
                bar.update(1)
        else:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
            tok = e.members[0].tokenizer
            prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
            windows, owner = [], []
            for i, d in enumerate(docs):
                for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=encode_text(tok, d, add_special_tokens=True),  # as HF's: BOS too
                        prefix_token=prefix, max_seq_len=e.max_length, context_len=1)):
                    windows.append(([list(ctx)] * len(e.members), list(cont)))
                    owner.append(i)
            scores = e.score_tokens(windows)
            out = [0.0] * len(docs)
            for i, (lp, _) in zip(owner, scores):
                out[i] += lp
            bar.update(len(docs))
        bar.close()
        for d, ans in zip(docs, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (d,), ans)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        from brf.fusion import Sampler
        args = [tuple(r.args) for r in requests]
        groups: dict[str, list[int]] = {}
        for i, (_, kw) in enumerate(args):
            groups.setdefault(repr(sorted(kw.items())), []).append(i)
        out: list[Any] = [None] * len(args)
        bar = tqdm(total=len(args), desc=f"brf generate_until ({self.level})",
                   disable=disable_tqdm)
        for idx in groups.values():
            kw = dict(args[idx[0]][1])
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_toks = int(next((kw.pop(k) for k in ("max_gen_toks", "max_new_tokens",
                                                      "max_tokens") if k in kw),
                                self.args.max_gen_toks))
            temperature = float(kw.pop("temperature", 0.0) or 0.0)
            do_sample = kw.pop("do_sample", temperature > 0)
            if do_sample and temperature == 0.0:
                temperature = 1.0
            sampler = Sampler.parse("greedy") if not do_sample else Sampler(
                temperature=temperature, top_k=int(kw.pop("top_k", 0) or 0),
                top_p=float(kw.pop("top_p", 1.0) or 1.0))
            idx = sorted(idx, key=lambda i: -len(args[i][0]))
            texts = self.ensemble.generate(
                [args[i][0] for i in idx], until=until, max_gen_toks=max_toks,
                max_gen_bytes=self.args.max_gen_bytes or 4 * max_toks, sampler=sampler,
                seed=self.args.seed)
            for i, t in zip(idx, texts):
                out[i] = t
                self.cache_hook.add_partial("generate_until", args[i], t)
            bar.update(len(idx))
        bar.close()
        return out


def byte_summary(reports) -> dict:
    """The byte level's pruned log-mass over answered requests: per member, the largest
    and the mean (nats), and the number of requests."""
    if not reports:
        return {}
    n = len(reports[0].lost)
    return dict(requests=len(reports),
                lost_max=[max(r.lost[j] for r in reports) for j in range(n)],
                lost_mean=[sum(r.lost[j] for r in reports) / len(reports) for j in range(n)])


__all__ = ["BRFLM", "ModelArgs", "NAME", "byte_summary", "commas"]
