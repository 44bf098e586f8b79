"""The shared event space the decoder fuses and samples over.

A *space* answers, for the decoding loop:

* ``align_all(logits)``: all members' next-token logits ([B, V_i] each) as
  log-probs over shared events, ``(logp_BxnxE, events)``; ``events`` maps a
  column to its event id (None: column = event);
* ``align_one(i, logits_BxV)``: member i alone, [B, E] (mixture sampling);
* ``mask_E``: events that every member can read (None: all), or None;
* ``is_eos(event)``: whether the event ends the sequence;
* ``advance(b, event, n_read)``: append the event to sequence b and return,
  per member, ``(n_retract, tokens)``: drop that many of its *pending* tokens,
  then add these (the re-encoding of the chosen text);
* ``text(b)``: the full text sequence b has generated.

:class:`IdentitySpace` serves same-vocabulary ensembles (one model under
several prompts, or models sharing a tokenizer): events are token ids, every
member reads the chosen id as it is, and text is the tokenizer's decoding of
the chosen ids. Cross-vocabulary spaces wrap ``brf.align``
(:mod:`brf.ensemble.aligned`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from brf.ensemble.member import EnsembleInputError, Member, check_shared_vocabulary


@jax.jit
def _log_softmax(logits_BxV):
    return jax.nn.log_softmax(logits_BxV, axis=-1)


class IdentitySpace:
    """Events = the shared vocabulary's token ids."""

    name = "identity"

    def __init__(self, members: Sequence[Member], batch: int):
        check_shared_vocabulary(members)
        self.members = list(members)
        self.size = members[0].cfg.vocab_size
        bad = [m.name for m in members if m.cfg.vocab_size != self.size]
        if bad:
            raise EnsembleInputError(f"members {bad} have a different number of logits than "
                             f"{members[0].name!r} ({self.size}) despite one tokenizer")
        self.tokenizer = members[0].tokenizer
        self.eos = frozenset().union(*(m.eos_ids() for m in members))
        self.ids: list[list[int]] = [[] for _ in range(batch)]

    mask_E = None
    supports_mixture = True

    def start(self, prompt_ids) -> None:
        """Keeps the prompt ids (members read the chosen token ids as they are)."""
        self.prompt_ids = prompt_ids

    def align_all(self, logits: Sequence[jax.Array]):
        return jnp.stack([_log_softmax(l) for l in logits], axis=1), None

    def align_one(self, i: int, logits_BxV: jax.Array) -> jax.Array:
        return _log_softmax(logits_BxV)

    def is_eos(self, event: int) -> bool:
        return int(event) in self.eos

    def token_mask(self, i: int):
        """Member i's tokens allowed for sampling (None: all)."""
        return None

    def token_events(self, i: int, tokens_B):
        """Member i's token ids -> events (here the same ids)."""
        return np.asarray(tokens_B)

    def advance(self, b: int, event: int, n_read: Sequence[int]):
        self.ids[b].append(int(event))
        return [(0, (int(event),))] * len(self.members)

    def text(self, b: int) -> str:
        return self.tokenizer.decode(self.ids[b], skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def raw(self, b: int) -> bytes:
        return self.text(b).encode("utf-8", errors="surrogateescape")

    def member_ids(self, i: int, b: int) -> tuple[int, ...]:
        return tuple(self.prompt_ids[i][b]) + tuple(self.ids[b])
