"""Runs brf ensembles on lm-evaluation-harness tasks (each member alone, pools, BRF).

  python experiments/harness.py --config=configs/harness.py
  python experiments/harness.py --config=configs/harness.py:tiny

Writes the harness's results JSON per variant and <output>/table.md; prints the table.
Needs the harness extra (pip install -e .[harness]). See configs/harness.py.
"""

from brf import cli  # first: Ctrl-C during the imports below ends in one line too

from ml_collections import config_flags

from brf.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", cli.default_config("harness.py"))


def main(argv):
    del argv
    c = _CONFIG.value
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError("lm-eval is not installed; pip install -e .[harness] (or bash "
                        "install.sh --harness)") from None
    cli.check_writable(c.output, "config.output", directory=True)
    from brf.harness.run import run, table
    rows = run(c)
    print(table(rows), end="")
    print(f"wrote {c.output}/table.md and each variant's results JSON")


if __name__ == "__main__":
    cli.run(main)
