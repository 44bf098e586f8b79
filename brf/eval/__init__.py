"""brf.eval: statistics and data for the validation experiments.

`brf.eval.stats` holds the tests and intervals (NumPy/SciPy, no JAX);
`brf.eval.corpus` loads the default evaluation text, offline.
"""
