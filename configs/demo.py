"""Fusion demo: two toy members, every method, one table.

Run:
  python experiments/demo.py --config=configs/demo.py
  python experiments/demo.py --config=configs/demo.py --config.weights='(0.7, 0.3)'
"""

import math

import ml_collections


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.tokens = ("Paris", "London", "Rome", "Berlin", "Madrid", "the")
    # Two members who agree that "Paris" is likely but disagree on the rest.
    c.member_names = ("member A", "member B")
    c.logits = ((3.0, 2.2, 0.5, 0.0, -1.0, 0.3),
                (3.0, -0.5, 2.4, 0.2, 0.0, 0.3))
    c.weights = (0.5, 0.5)
    c.rows = [
        dict(method="linear", label="linear pool"),
        dict(method="loglinear", label="log-linear (T=1)"),
        dict(method="power", alpha=0.5, label="power mean a=1/2 (Hellinger)"),
        dict(method="max", label="max pool"),
        dict(method="min", label="min pool"),
        dict(method="routing", label="routing (most confident)"),
        dict(method="entropy_gated", threshold=1.0, label="entropy-gated (H>1 nat)"),
        dict(method="contrastive", beta=0.5, label="contrastive A - 0.5 B"),
    ] + [
        dict(method="born", phase=f"constant(offset=[0, {d:.4f}])",
             label=f"born, phase diff {name}")
        for d, name in [(0.0, "0"), (math.pi / 2, "pi/2"), (2 * math.pi / 3, "2pi/3"),
                        (math.pi, "pi")]
    ] + [
        dict(method="born", phase="tanh(rate=1.0, offset=[0, 1.0])",
             label="born, tanh(gap) + offsets"),
        dict(method="born", phase="token_tanh(rate=0.8)", label="born, per-token tanh"),
    ]
    c.cross_terms_phase = "constant(offset=[0, 2.0944])"
    return c
