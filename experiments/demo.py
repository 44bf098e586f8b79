"""Fuses two toy distributions with every method and prints the table.

  python experiments/demo.py --config=configs/demo.py
"""

from brf import cli  # first: Ctrl-C during the imports below ends in one line too

from ml_collections import config_flags

from brf.eval.tables import check_config, cross_terms_table, fusion_table

_CONFIG = config_flags.DEFINE_config_file("config", cli.default_config("demo.py"))


def main(argv):
    del argv
    c = _CONFIG.value
    check_config(c)
    print("Next-token probabilities (%), two members and their fusions:\n")
    print(fusion_table(c.logits, c.tokens, c.rows, weights=c.weights,
                       member_names=c.member_names))
    print(f"\nBorn decomposition for phase map {c.cross_terms_phase}:\n")
    print(cross_terms_table(c.logits, c.tokens, c.cross_terms_phase, c.weights))


if __name__ == "__main__":
    cli.run(main)
