"""README.md and the docs pages: every command they show parses, the map of docs/
is whole, and CI runs README's test command.

The commands' behaviour is tested elsewhere on tiny settings (tests/test_cli.py,
tests/test_runtime_install.py, the mains' own tests); here each documented command
line is parsed as its main parses it (flags, the config file with its argument,
every --config override), so a page cannot name a flag, a config argument or a
config field that no longer exists.
"""

import json
import os
import re
import subprocess
import sys

from tests.docs_commands import ROOT, documented


def test_every_documented_command_parses(tmp_path):
    commands = documented()
    where = {m for m, _ in commands}
    assert len(commands) >= 25 and {"README.md (code)", "csv.md (code)", "decoding.md (code)",
                                     "study.md (code)", "sharding.md (code)"} <= where, where
    by_main: dict[str, list[list[str]]] = {}
    for _, argv in commands:
        assert (ROOT / argv[0]).is_file(), argv
        by_main.setdefault(argv[0], []).append(argv)
    path = tmp_path / "commands.json"
    path.write_text(json.dumps(by_main))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "docs_commands.py"), str(path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("PARSED ")]
    assert res.returncode == 0 and line, res.stderr[-3000:]
    parsed = json.loads(line[-1][len("PARSED "):])
    failed = [(" ".join(argv), err) for main, argvs in by_main.items()
              for argv, err in zip(argvs, parsed[main]) if err]
    assert not failed, failed


def test_the_readme_maps_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", readme))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert linked == pages, (linked ^ pages)
    for page in pages:  # links between the pages and to the rest of the repository
        text = (ROOT / page).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (ROOT / "docs" / target).exists(), (page, target)


def test_ci_runs_the_readmes_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"\*\*Run the tests\*\*[^\n]*\n\n    (.+)\n", readme)
    assert blocks, "README lost its test command"
    assert blocks[0] in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
