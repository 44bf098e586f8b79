"""Runs one main on many command lines in this one process (for tests/test_cli.py).

    python tests/cli_cases.py MAIN.py CASES.json

CASES.json holds a list of argv lists (argv[0] the program's name). Each is run as
``brf.cli.run(main, argv)`` runs it from a terminal, with absl's flags reset in
between, its stderr captured; prints one JSON line: per case {"status", "stderr"}.
A process per main instead of per case spares the start (Python, JAX, the main's
imports: most of each case's time).
"""

import contextlib
import io
import json
import runpy
import sys

from absl import flags


def main(path: str, cases_file: str) -> None:
    from brf import cli
    module = runpy.run_path(path, run_name="cli_cases_main")
    with open(cases_file, encoding="utf-8") as f:
        cases = json.load(f)
    defined = set(flags.FLAGS)
    out = []
    for argv in cases:
        # Back to the flags the main defined: ml_collections defines one flag per
        # --config.<field> override when it parses one, and would refuse it twice.
        for name in [n for n in flags.FLAGS if n not in defined]:
            delattr(flags.FLAGS, name)
        flags.FLAGS.unparse_flags()
        sys.argv = list(argv)
        err = io.StringIO()
        status = 0
        with contextlib.redirect_stderr(err):
            try:
                cli.run(module["main"], argv=list(argv))
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out.append(dict(status=status, stderr=err.getvalue()))
    print("CASES " + json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
