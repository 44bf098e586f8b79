"""Ensemble members: a model, its tokenizer, a conditioning prefix and a weight.

A :class:`Member` is one voice of the ensemble. Two members may share one
model (the same params and tokenizer) and differ only in their conditioning
prefix, e.g. two system prompts: that is a real same-vocabulary ensemble.

Checks that must hold before generation starts live here too, so that bad
input fails with a clear message instead of deep inside a jit trace.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from brf.align.vocab import encode_template, encode_text
from brf.errors import UserError
from brf.models.config import ModelConfig


class EnsembleInputError(UserError):
    """Bad ensemble input (members, weights, prompts, method); raised before decoding."""


@dataclasses.dataclass(frozen=True, eq=False)
class Member:
    """One member of an ensemble.

    Attributes:
        name: a label for reports and error messages.
        cfg: the model architecture.
        params: the params pytree (shared, not copied, between members of one model).
        tokenizer: a transformers fast tokenizer (``encode``/``decode``).
        weight: the member's weight before normalisation; None = uniform.
        prefix: conditioning text. Plain members read ``prefix + prompt``; chat
            members get it as the system message.
        chat: wrap the prompt in the tokenizer's chat template (with a
            generation prompt), so instruct models answer it.
        template: for tokenizers without a chat template: a format string with
            ``{prompt}`` (and optionally ``{prefix}``), e.g. Gemma's
            ``"<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"``;
            special-token literals in it become special tokens.

    Text is text: a special token's characters in the prompt or the prefix are
    read as those characters (`brf.align.vocab.encode_text`); control tokens come
    only from the chat template, the member's template and the tokenizer's BOS /
    EOS rules.
    """

    name: str
    cfg: ModelConfig
    params: Any
    tokenizer: Any
    weight: float | None = None
    prefix: str = ""
    chat: bool = False
    template: str | None = None

    def prompt_ids(self, prompt: str) -> list[int]:
        """The token ids this member conditions on for ``prompt`` (prefix and BOS included)."""
        tok = self.tokenizer
        if self.template is not None:
            if self.chat:
                raise EnsembleInputError(f"member {self.name!r}: give chat=True or a template, "
                                         "not both")
            return encode_template(tok, lambda f: self.template.format(**f),
                                   {"prompt": prompt, "prefix": self.prefix},
                                   add_special_tokens=True)
        if self.chat:
            if getattr(tok, "chat_template", None) is None:
                raise EnsembleInputError(f"member {self.name!r}: chat=True but its tokenizer "
                                         "has no chat template")

            def render(f):
                msgs = ([{"role": "system", "content": f["prefix"]}] if f["prefix"] else [])
                msgs.append({"role": "user", "content": f["prompt"]})
                return tok.apply_chat_template(msgs, add_generation_prompt=True,
                                               tokenize=False)
            return encode_template(tok, render, {"prompt": prompt, "prefix": self.prefix})
        return encode_text(tok, self.prefix + prompt, add_special_tokens=True)

    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a sequence for this member (model config and tokenizer)."""
        ids = set(self.cfg.eos_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
        return frozenset(ids)


TEMPLATE_FIELDS = ("prompt", "prefix")


def check_template(template: str, where: str = "template") -> None:
    """Refuses a prompt template that would not use the prompt: one without a
    ``{prompt}`` field (every prompt would give the same text), one naming a field
    other than ``{prompt}`` and ``{prefix}``, or one that is not a format string
    (a lone ``{``; write ``{{`` for a brace).

    Raises:
        EnsembleInputError: naming ``where`` and the field.
    """
    import string
    if not isinstance(template, str):
        raise EnsembleInputError(f"{where} must be a string with {{prompt}}; got {template!r}")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise EnsembleInputError(f"{where} {template!r} is not a format string ({e}); write "
                                 "{{ and }} for literal braces") from None
    bad = sorted({f for f in fields if f not in TEMPLATE_FIELDS})
    if bad:
        raise EnsembleInputError(f"{where} {template!r} names unknown field(s) "
                                 f"{', '.join('{' + f + '}' for f in bad)}; it may use "
                                 "{prompt} and {prefix} (write {{ and }} for literal braces)")
    if "prompt" not in fields:
        raise EnsembleInputError(f"{where} {template!r} has no {{prompt}} field, so every "
                                 "prompt would give the same text; put {prompt} where the "
                                 "prompt goes")


def from_model(model: Any, name: str | None = None, **kwargs) -> Member:
    """A Member from a loaded ``brf.checkpoints.registry.Model`` (cfg, params, tokenizer)."""
    if model.tokenizer is None:
        raise EnsembleInputError(f"model {name or model.path!r} has no tokenizer")
    return Member(name=name or str(model.path), cfg=model.cfg, params=model.params,
                  tokenizer=model.tokenizer, **kwargs)


def normalised_weights(members: Sequence[Member],
                       weights: Sequence[float] | None = None) -> np.ndarray:
    """The ensemble weights on the simplex, checked against the members.

    Args:
        members: the ensemble.
        weights: explicit weights (one per member, summing to 1), or None to
            take each member's ``weight`` (all None = uniform; the members'
            weights must then sum to 1 too: brf never renormalises silently).

    Returns:
        float64 weights [n].

    Raises:
        EnsembleInputError: wrong count, negative / non-finite values, all zero,
            or not summing to 1.
    """
    n = len(members)
    if n == 0:
        raise EnsembleInputError("an ensemble needs at least one member")
    if weights is None:
        given = [m.weight for m in members]
        if all(w is None for w in given):
            return np.full(n, 1.0 / n)
        if any(w is None for w in given):
            missing = [m.name for m in members if m.weight is None]
            raise EnsembleInputError(f"members {missing} have no weight while others do; "
                                     "give every member a weight or none")
        weights = given
    w = np.asarray(weights, np.float64).reshape(-1)
    if w.shape != (n,):
        raise EnsembleInputError(f"{w.size} weights for {n} members "
                                 f"({[m.name for m in members]}); give one weight per member")
    if not np.isfinite(w).all() or (w < 0).any():
        raise EnsembleInputError(f"weights must be finite and >= 0; got {w.tolist()}")
    if not math.isclose(w.sum(), 1.0, abs_tol=1e-6):
        raise EnsembleInputError(f"weights must sum to 1; they sum to {w.sum():.6g} "
                                 f"({w.tolist()}); pass w / sum(w) if that is what you mean")
    return w


def same_vocabulary(a: Member, b: Member) -> bool:
    """True when two members' tokenizers map the same strings to the same ids."""
    if a.tokenizer is b.tokenizer:
        return True
    return a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


def special_tokens(m: Member) -> dict[str, Any]:
    """The tokenizer's special-token facts that must agree between same-vocabulary members.

    The model config's extra EOS ids (``cfg.eos_ids``) may differ: generation
    stops at the EOS of any member.
    """
    tok = m.tokenizer
    return {"bos": getattr(tok, "bos_token_id", None),
            "eos": getattr(tok, "eos_token_id", None),
            "pad": getattr(tok, "pad_token_id", None),
            "special": sorted(getattr(tok, "all_special_ids", []) or [])}


def check_shared_vocabulary(members: Sequence[Member]) -> None:
    """Raises unless all members share one vocabulary and agree about special tokens.

    Same-vocabulary ensembles exchange token ids directly, so a token that is
    EOS (or BOS, or otherwise special) for one member must be so for every
    member, or one member would see text where another sees a control token.
    """
    ref = members[0]
    for m in members[1:]:
        if not same_vocabulary(ref, m):
            raise EnsembleInputError(
                f"members {ref.name!r} and {m.name!r} have different vocabularies; use a "
                "vocabulary aligner (brf.align) instead of 'identity'")
        a, b = special_tokens(ref), special_tokens(m)
        diff = [k for k in a if a[k] != b[k]]
        if diff:
            detail = "; ".join(f"{k}: {a[k]} vs {b[k]}" for k in diff)
            raise EnsembleInputError(
                f"members {ref.name!r} and {m.name!r} share a vocabulary but disagree about "
                f"special tokens ({detail})")
    for m in members:
        if len(m.tokenizer) > m.cfg.vocab_size:
            raise EnsembleInputError(f"member {m.name!r}: tokenizer has {len(m.tokenizer)} "
                                     f"tokens, the model only {m.cfg.vocab_size} logits")


def _check_prompt(prompt: Any, where: str) -> str:
    """One prompt against the rule of :func:`check_prompts`; returns it."""
    if not isinstance(prompt, str):
        raise EnsembleInputError(f"{where} must be a string (text); got "
                                 f"{type(prompt).__name__} {prompt!r}"[:200])
    if not prompt.strip():
        raise EnsembleInputError(f"{where} is {'empty' if not prompt else 'only whitespace'}; "
                                 "give it text or leave it out (each prompt makes one output "
                                 "row, in order)")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        # A command-line argument with bytes that are not UTF-8 arrives surrogate-escaped,
        # a JSON line may hold a lone \udXXX escape; neither can be tokenized.
        try:
            shown = repr(prompt.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:
            shown = repr(prompt)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise EnsembleInputError(f"{where} is not valid UTF-8 text (at character "
                                 f"{e.start}): {shown}") from None
    return prompt


def check_prompts(prompts: Any, where: str = "prompts") -> list[str]:
    """The prompts as a list, each checked by the one rule for prompts.

    The rule, for every source (a list or tuple given to the Python API or a
    config, the lines of a prompts file or of dump_logits' ``config.prompts``, a
    JSONL line's ``"prompt"``): a prompt is a string of valid UTF-8 text that is
    not empty and not only whitespace. Nothing is skipped, so prompt i is output
    row i (``seq = i - 1``). One string is one prompt.

    Args:
        prompts: a string, or a sequence of strings.
        where: how the user gave them, for messages (``config.prompts``).

    Raises:
        EnsembleInputError: no prompts, or the first prompt that breaks the rule,
            named by its number.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    try:
        out = None if isinstance(prompts, (bytes, bytearray, dict)) else list(prompts)
    except TypeError:
        out = None
    if out is None:
        raise EnsembleInputError(f"{where} must be a string or a list of strings; got "
                                 f"{type(prompts).__name__} {prompts!r}"[:200])
    if not out:
        raise EnsembleInputError(f"no prompts: {where} is empty")
    return [_check_prompt(p, f"{where}: prompt {i}") for i, p in enumerate(out, 1)]


def prompt_lines(text: str, where: str) -> list[str]:
    """The prompts of a text with one prompt a line (a prompts file, dump_logits'
    ``config.prompts``); a line that is a JSON object gives its ``"prompt"`` field.
    Every line is a prompt under the rule of :func:`check_prompts`: a blank line
    is refused (skipping it would shift the rows against the lines), except that a
    text with no prompt at all says so.

    Raises:
        EnsembleInputError: naming ``where`` and the line.
    """
    import json
    lines = text.splitlines()
    if not any(line.strip() for line in lines):
        raise EnsembleInputError(f"{where} holds no prompts (it is empty or blank)")
    out = []
    for i, line in enumerate(lines, 1):
        at = f"{where}, line {i}"
        if line.lstrip().startswith("{"):
            try:
                line = json.loads(line)["prompt"]
            except (ValueError, KeyError, TypeError):
                raise EnsembleInputError(f"{at}: a JSON line needs a string field "
                                         "'prompt'") from None
            at += ": 'prompt'"
        out.append(_check_prompt(line, at))
    return out


def check_prompt_fits(m: Member, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    """Raises if a member's conditioning plus prompt does not fit its context."""
    n = len(prompt_ids)
    if n == 0:
        raise EnsembleInputError(f"member {m.name!r}: empty prompt (and no prefix or BOS); "
                                 "nothing to condition on")
    if n >= m.cfg.max_seq_len:
        raise EnsembleInputError(
            f"member {m.name!r}: the prompt is {n} tokens (prefix included), longer than "
            f"its context of {m.cfg.max_seq_len} tokens")
    if n + max_new_tokens > m.cfg.max_seq_len:
        raise EnsembleInputError(
            f"member {m.name!r}: prompt ({n} tokens) + max_new_tokens ({max_new_tokens}) "
            f"exceeds its context of {m.cfg.max_seq_len} tokens")
