"""The commands README.md and docs/*.md show, and a runner that parses them.

    python tests/docs_commands.py COMMANDS.json

COMMANDS.json maps each main's path to a list of argv lists (argv[0] the program).
Each is parsed as the main would parse it (absl flags, the config file with its
argument and every ``--config.<field>`` override), all in this one process, the
flags reset in between; nothing is run. Prints one JSON line: per main, per
command, None or the error.
"""

import json
import pathlib
import re
import runpy
import shlex
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
_COMMAND = re.compile(r"python3? (experiments/\w+\.py)")


def _argv(text: str) -> list[str]:
    """The argv of the command that starts ``text`` (up to a shell operator, the end
    of a quoted string it sits in, or a comment); ``$VARIABLES`` read as 0."""
    text = re.split(r"&&|\|\||(?<!\|)\|(?!\|)|;|`", text)[0].rstrip().rstrip('"')
    text = re.sub(r"\$\{?\w+\}?", "0", text)
    return shlex.split(text, comments=True)[1:]  # argv[0] is the program, not python


def documented(paths=None) -> list[tuple[str, list[str]]]:
    """(where, argv) of every ``python experiments/<main>.py ...`` command in the
    pages: in code blocks (lines joined at a trailing backslash) and in inline code
    (which may wrap across the lines of its paragraph)."""
    paths = paths or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    out = []
    for path in paths:
        text = re.sub(r"```python\n.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for block in re.split(r"\n\s*\n", text):
            lines = block.split("\n")
            if all(ln.startswith("    ") or not ln.strip() for ln in lines):  # code
                where, chunks = "code", re.sub(r"\\\n\s*", " ", block).split("\n")
            else:  # prose: its inline code spans
                where = "inline"
                chunks = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", block)]
            for chunk in chunks:
                for m in _COMMAND.finditer(chunk):
                    out.append((f"{path.name} ({where})", _argv(chunk[m.start():])))
    return out


def main(commands_file: str) -> None:
    """Parses every command of ``commands_file`` ({main path: [argv, ...]}), main by
    main in this one process: each main's flags are dropped before the next one is
    imported (several define --config)."""
    from absl import flags
    with open(commands_file, encoding="utf-8") as f:
        commands = json.load(f)
    base = set(flags.FLAGS)
    out = {}
    for path, argvs in commands.items():
        for name in [n for n in flags.FLAGS if n not in base]:
            delattr(flags.FLAGS, name)
        module = runpy.run_path(str(ROOT / path), run_name="docs_commands_main")
        defined = set(flags.FLAGS)
        out[path] = []
        for argv in argvs:
            for name in [n for n in flags.FLAGS if n not in defined]:
                delattr(flags.FLAGS, name)  # ml_collections' per-override flags
            flags.FLAGS.unparse_flags()
            sys.argv = list(argv)  # ml_collections reads the overrides from sys.argv
            try:
                flags.FLAGS(argv)
                if "_CONFIG" in module:
                    module["_CONFIG"].value  # the config file, loaded with its argument
                out[path].append(None)
            except BaseException as e:  # noqa: BLE001 (SystemExit too: a flag's own exit)
                out[path].append(f"{type(e).__name__}: {e}"[:2000])
    print("PARSED " + json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(*sys.argv[1:])
