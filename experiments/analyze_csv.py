"""Phase coherence, cross-term statistics and fusion on two or more logit CSVs.

  python experiments/analyze_csv.py --config=configs/analyze_csv.py --config.csvs=a.csv,b.csv

See configs/analyze_csv.py and brf/eval/csv_analysis.py.
"""

from brf import cli  # first: Ctrl-C during the imports below ends in one line too

from ml_collections import config_flags

from brf.eval.csv_analysis import check_config, run

_CONFIG = config_flags.DEFINE_config_file("config", cli.default_config("analyze_csv.py"))


def main(argv):
    del argv
    check_config(_CONFIG.value)  # every key's type, range and names
    cli.check_writable(_CONFIG.value.out_dir, "config.out_dir", directory=True)
    paths = run(_CONFIG.value)
    print(open(paths["markdown"]).read())
    print(f"Report: {paths['markdown']}, {paths['json']}, plots: {', '.join(paths['plots'])}")


if __name__ == "__main__":
    cli.run(main)
