"""The main job: the study of Born Rule Fusion on real models (brf/eval/study.py).

  python experiments/validate.py --config=configs/validate.py

Writes report.json, report.md and PNG plots to --config.out_dir (and a full
report per corpus in its subdirectory; the study on every byte, config.bytes, in
each corpus's bytes/), reusing the member scores and fits stored there by an
earlier (possibly interrupted) run.
"""

from brf import cli  # first: Ctrl-C during the imports below ends in one line too

from ml_collections import config_flags

from brf import sharding
from brf.ensemble.run import check_fusable
from brf.eval import plan as plan_lib
from brf.eval.study import run
from brf.runtime import enable_compilation_cache

_CONFIG = config_flags.DEFINE_config_file("config", cli.default_config("validate.py"))


def main(argv):
    del argv
    cfg = _CONFIG.value
    plan_lib.check_config(cfg)  # every key's type and range, before JAX starts
    sharding.initialize_distributed(cfg.distributed)  # before any other JAX use
    plan = plan_lib.from_config(cfg)  # every mistake in the config is named here
    # a member the study cannot read across vocabularies, before its model converts
    check_fusable([{"model": m.name} for m in plan.members], reencode=False,
                  level="bytes" if plan.bytes.enabled else "tokens")
    cli.check_writable(plan.out_dir, "config.out_dir", directory=True)
    if cfg.compilation_cache:
        enable_compilation_cache(cfg.compilation_cache_dir or None)
    rep = run(plan)
    if rep is None:  # multi-host: another process merges the stores and reports
        print(f"\nScored this process's share into {plan.out_dir}; process 0 writes the report.")
        return
    print(f"\nReport: {plan.out_dir}/report.md ({rep['seconds']:.0f} s)\n")
    for k, v in rep["verdict"].items():
        print(f"- {k}: {v}")
    if rep.get("bytes"):  # the study on every byte
        print(f"\nOn every byte ({rep['bytes']['seconds']:.0f} s):\n")
        for k, v in rep["bytes"]["verdict"].items():
            print(f"- {k}: {v}")


if __name__ == "__main__":
    cli.run(main)
