"""Born fusion token by token, explained: what each member said and what interference did.

:func:`interference_steps` generates greedily from an ensemble with Born fusion
and returns, for every step, the top events of the fused distribution with
each member's probability, the linear part ``sum_i w_i p_i``, the
interference (cross) term and the fused probability, plus Z and the
members' phases. The quickstart notebook plots these; they are also a quick
way to see on which tokens BRF departs from the linear pool.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from brf.align import token_table
from brf.ensemble.decode import generate, make_space
from brf.ensemble.member import Member, normalised_weights
from brf.fusion import born_terms, phase_map


@dataclasses.dataclass
class Step:
    """One generated event and the fused distribution's top events at that step.

    Attributes:
        chosen: the text of the chosen event.
        events: [K] texts of the top-K events of the fused distribution.
        event_ids: [K] their ids (token ids for same-vocabulary members, else
            union-event ids).
        member_p: [n, K] each member's probability of those events.
        linear: [K] the linear pool sum_i w_i p_i.
        cross: [K] the interference term sum_{i<j} 2 sqrt(w_i w_j p_i p_j) cos(dphi).
        fused: [K] BRF's probability (linear + cross) / z.
        z: the normaliser (1 + total interference).
        phases: [n] member phases (per-position maps; None for per-token maps).
    """
    chosen: str
    events: list[str]
    event_ids: np.ndarray
    member_p: np.ndarray
    linear: np.ndarray
    cross: np.ndarray
    fused: np.ndarray
    z: float
    phases: np.ndarray | None


def _event_text(space, table, event: int) -> str:
    """An event's exact bytes as text; bytes that are not UTF-8 as \\xNN escapes."""
    if hasattr(space, "alignment"):
        data = space.alignment.event_bytes(int(event))
    else:
        data = table.token_bytes[int(event)]
    return data.decode("utf-8", errors="backslashreplace")


def interference_steps(members: Sequence[Member], prompt: str, *,
                       phase: Any = "tanh(rate=0.5, offset=[0, 0.5])",
                       weights: Sequence[float] | None = None, max_new_tokens: int = 16,
                       top: int = 5, aligner: str = "auto") -> tuple[str, list[Step]]:
    """Greedy Born-fusion generation with the interference at every step.

    Args:
        members: the ensemble (any vocabularies; 'auto' aligns different ones on
            the union of their byte strings).
        prompt: the prompt.
        phase: Born fusion's phase map (``brf.fusion.PHASE_MAPS`` spec).
        weights: member weights (default: the members' own, else uniform).
        max_new_tokens: events to generate.
        top: K, events shown per step.
        aligner: 'auto', 'identity', 'union'.

    Returns:
        (generated text, one :class:`Step` per event).
    """
    from brf.ensemble.run import auto_aligner
    members = list(members)
    aligner = auto_aligner(members) if aligner == "auto" else aligner
    w = normalised_weights(members, weights)
    gen = generate(members, [prompt], weights=w, method="born",
                   method_params={"phase": phase}, sampler="greedy",
                   max_new_tokens=max_new_tokens, aligner=aligner, trace=True)[0]
    space = make_space(aligner, members, 1)
    table = token_table(members[0].tokenizer)
    pm = phase_map(phase)
    steps = []
    for s in gen.trace:
        logp_nxE = jnp.stack([jnp.asarray(s["member_logp"][i]) for i in range(len(members))])
        terms = born_terms(logp_nxE, jnp.asarray(w, jnp.float32), pm)
        logq = np.asarray(s["logq"], np.float64)
        cols = np.argsort(-logq)[:top]
        ev = np.asarray(s["events"]) if s["events"] is not None else None
        ids = cols if ev is None else ev[cols]
        p = np.exp(np.asarray(logp_nxE, np.float64))[:, cols]
        cross = np.asarray(terms.cross, np.float64).sum(0)[cols]
        phases = None if pm.kind == "token" else np.asarray(terms.phase, np.float64)
        steps.append(Step(chosen=_event_text(space, table, s["event"]),
                          events=[_event_text(space, table, e) for e in ids],
                          event_ids=np.asarray(ids),
                          member_p=p, linear=np.asarray(terms.linear, np.float64)[cols],
                          cross=cross, fused=np.exp(logq[cols]), z=float(terms.z),
                          phases=phases))
    return gen.text, steps
