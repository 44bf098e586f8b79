"""The event table: what every fit and every score reads, at either level.

Both levels (co-aligned positions, :mod:`brf.eval.events`; every byte,
:mod:`brf.bytes.scoring`) produce one: per position, each member's
log-probabilities over one shared event space and the gold event. It lives
here, below both packages, so that neither imports the other to build one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class EventTable(NamedTuple):
    """Member log-probs over a shared event space, one row per position.

    Attributes:
      logp: [P, n, E] float32 log-probabilities (-inf: the member gives the
        event no mass; padding events are -inf for every member).
      gold: [P] int index of the gold event.
      gap: [P, n] each member's true top-1 minus top-2 logit gap.
      gold_bytes: [P] UTF-8 bytes of the gold event (for bits per byte).
      segment: [P] corpus segment of each position.
      gold_offset: [P] float64 log-probability added to the gold event's to score
        the gold string: 0 where the gold is an event of its own, the log of its
        share of OTHER where it is one of the strings OTHER stands for
        (:mod:`brf.eval.events`); None: 0 everywhere. The same for every method,
        so no fit sees it; such positions give no top-1 credit.
    """
    logp: np.ndarray
    gold: np.ndarray
    gap: np.ndarray
    gold_bytes: np.ndarray
    segment: np.ndarray
    gold_offset: np.ndarray | None = None

    def take(self, idx) -> "EventTable":
        return EventTable(*(None if a is None else np.asarray(a)[idx] for a in self))

    @property
    def offset(self) -> np.ndarray:
        """[P] float64 gold offsets (zeros when the table has none)."""
        if self.gold_offset is None:
            return np.zeros(self.n_positions)
        return np.asarray(self.gold_offset, np.float64)

    @property
    def gold_listed(self) -> np.ndarray:
        """[P] bool: the gold is an event of its own (not folded into OTHER)."""
        return self.offset == 0.0

    @property
    def n_positions(self) -> int:
        return int(self.logp.shape[0])
