"""The shared event space the decoder fuses and samples over.

A *space* answers four questions for the decoding loop:

* ``aligned(i, logits_BxV)``: member i's next-token logits as log-probs over
  the shared events [B, U] (a proper distribution; -inf = impossible);
* ``tokens_for(b, event, i)``: the token ids member i must read after event
  ``event`` was chosen for sequence b (the re-encoding of the chosen text);
* ``is_eos(event)``: whether the event ends the sequence;
* ``text(b)``: the full text sequence b has generated.

:class:`IdentitySpace` serves same-vocabulary ensembles (one model under
several prompts, or models sharing a tokenizer): events are token ids, every
member reads the chosen id as it is, and text is the tokenizer's decoding of
the chosen ids. Cross-vocabulary spaces wrap the aligners of ``brf.align``.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from brf.ensemble.member import Member, check_shared_vocabulary


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
            raise ValueError(f"members {bad} have a different number of logits than "
                             f"{members[0].name!r} ({self.size}) despite one tokenizer")
        self.tokenizer = members[0].tokenizer
        self.eos = frozenset().union(*(m.eos_ids() for m in members))
        self.ids: list[list[int]] = [[] for _ in range(batch)]

    def aligned(self, i: int, logits_BxV: jax.Array) -> jax.Array:
        return _log_softmax(logits_BxV)

    def is_eos(self, event: int) -> bool:
        return int(event) in self.eos

    def choose(self, b: int, event: int) -> None:
        """Records that ``event`` was appended to sequence b."""
        self.ids[b].append(int(event))

    def tokens_for(self, b: int, event: int, i: int) -> list[int]:
        return [int(event)]

    def text(self, b: int) -> str:
        return self.tokenizer.decode(self.ids[b], skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
