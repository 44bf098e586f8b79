"""Samplers applied to a (fused) next-token distribution.

A :class:`Sampler` chains, in this order: temperature, top-k, top-p (nucleus),
min-p. ``temperature == 0`` means greedy (argmax; ties go to the lowest id).
Each stage renormalises before the next reads it. Sampling is deterministic
given the PRNG key.

Conventions: top-k keeps every token whose log-prob is >= the k-th largest
(ties at the boundary are kept); top-p keeps the smallest prefix of tokens in
descending probability (ties broken by lower id first) whose mass reaches p;
min-p keeps tokens with p(t) >= min_p * max_t p(t). The top token always
survives.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from brf.fusion.checks import FusionInputError


@dataclasses.dataclass(frozen=True)
class Sampler:
    """A sampling rule. All fields at their defaults = plain sampling."""
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1 = off
    min_p: float = 0.0      # 0 = off

    def __post_init__(self):
        t, k, p, mp = self.temperature, self.top_k, self.top_p, self.min_p
        if not (isinstance(t, (int, float)) and t >= 0 and t == t
                and t != float("inf")):
            raise FusionInputError(f"temperature must be a finite number >= 0; got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise FusionInputError(f"top_k must be an integer >= 0; got {k!r}")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise FusionInputError(f"top_p must lie in (0, 1]; got {p!r}")
        if not (isinstance(mp, (int, float)) and 0 <= mp <= 1):
            raise FusionInputError(f"min_p must lie in [0, 1]; got {mp!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def parse(cls, spec: "str | Mapping[str, Any] | Sampler | None") -> "Sampler":
        """From ``"greedy"``, ``"temperature=0.7,top_p=0.9"``, a dict or a Sampler."""
        if spec is None:
            return cls()
        if isinstance(spec, Sampler):
            return spec
        if isinstance(spec, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = set(spec) - fields
            if unknown:
                raise FusionInputError(
                    f"unknown sampler field(s) {sorted(unknown)}; known: {sorted(fields)}")
            return cls(**spec)
        if not isinstance(spec, str):
            raise FusionInputError(f"a sampler is a string or a dict; got {spec!r}")
        spec = spec.strip()
        if spec in ("greedy", "argmax"):
            return cls(temperature=0.0)
        if spec in ("", "sample", "ancestral"):
            return cls()
        out = {}
        for part in spec.split(","):
            key, sep, value = part.partition("=")
            if not sep:
                raise FusionInputError(
                    f"cannot parse sampler {spec!r}; write e.g. 'temperature=0.7,top_k=50'")
            key = key.strip()
            try:
                out[key] = int(value) if key == "top_k" else float(value)
            except ValueError:
                raise FusionInputError(f"sampler field {key}={value!r} is not a number") from None
        return cls.parse(out)


def _renormalise(logp):
    return logp - jax.nn.logsumexp(logp, axis=-1, keepdims=True)


def filter_logprobs(logp_XV: jax.Array, sampler: Sampler) -> jax.Array:
    """The distribution ``sampler`` draws from, as normalised log-probs [..., V]."""
    logp = logp_XV
    if sampler.greedy:
        top = jnp.argmax(logp, axis=-1)
        onehot = jax.nn.one_hot(top, logp.shape[-1], dtype=bool)
        return jnp.where(onehot, 0.0, -jnp.inf).astype(logp.dtype)
    if sampler.temperature != 1.0:
        logp = _renormalise(logp / sampler.temperature)
    if sampler.top_k and sampler.top_k < logp.shape[-1]:
        kth = jax.lax.top_k(logp, sampler.top_k)[0][..., -1:]
        logp = _renormalise(jnp.where(logp >= kth, logp, -jnp.inf))
    if sampler.top_p < 1.0:
        order = jnp.argsort(-logp, axis=-1, stable=True)
        sorted_p = jnp.exp(jnp.take_along_axis(logp, order, axis=-1))
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = before < sampler.top_p
        keep_sorted = keep_sorted.at[..., 0].set(True)
        keep = jnp.zeros_like(keep_sorted)
        keep = jnp.put_along_axis(keep, order, keep_sorted, axis=-1, inplace=False)
        logp = _renormalise(jnp.where(keep, logp, -jnp.inf))
    if sampler.min_p > 0.0:
        cut = jnp.max(logp, axis=-1, keepdims=True) + jnp.log(sampler.min_p)
        logp = _renormalise(jnp.where(logp >= cut, logp, -jnp.inf))
    return logp


def sample(key: jax.Array, logp_XV: jax.Array,
           sampler: Sampler | str | None = None) -> jax.Array:
    """Draws token ids [...] from log-probs [..., V] under ``sampler``."""
    sampler = Sampler.parse(sampler)
    if sampler.greedy:
        return jnp.argmax(logp_XV, axis=-1).astype(jnp.int32)
    logp = filter_logprobs(logp_XV, sampler)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
