"""Speculative fused decoding against plain fused decoding, side by side in one run.

  python experiments/bench_speculative.py                     # both cases
  python experiments/bench_speculative.py --cases=prompts --max_new=64 --repeats=2
  python experiments/bench_speculative.py --cases=bytes --drafters='ngram(n=4, k=8)'
  python experiments/bench_speculative.py --cases=prompts --engines=host,device

Two cases (issue 40):

* ``prompts`` (tokens): SmolLM2-135M-Instruct under two system prompts (a prompt
  ensemble; the members share weights and are read as one batch), BRF. Rows: one
  member alone (plain decoding), the plain fused ensemble, and the fused ensemble
  decoded speculatively by each drafter.
* ``bytes``: the default pair (SmolLM2 + Gemma 3, different tokenizers) fused on
  bytes (`brf.bytes.generate`), plain and speculative (`brf.bytes.speculative`).

Every row is run once untimed (compilation), then all rows are timed in turn
(``repeats`` rounds, best kept), so a shared machine's drift hits every row alike.
Greedy decoding by default, so each speculative row must give exactly the plain
row's text (checked and printed); with ``--sampler`` the texts follow the same law,
not the same draws ("same text" reads "sampled"), so each row times its own text.
Prints a markdown table per case: the first call's seconds (compilation included, of
the programs no earlier row compiled), tokens (bytes) per second,
speedup over plain fused decoding, acceptance (accepted / drafted) and the mean
number of units emitted per verification round; on bytes also each member's
forward tokens after its context and its tree calls.
"""

import importlib.util
import pathlib
import platform
import time

from absl import flags
import jax

from brf import cli
from brf.benchmark import markdown_table
from brf.errors import UserError
from brf.fusion import Sampler

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", ["prompts", "bytes"], "prompts (tokens) and/or bytes")
flags.DEFINE_multi_string("drafters", ["ngram(n=3, k=4)", "ngram(n=3, k=8)", "member(k=4)"],
                          "speculative drafters (brf.drafting specs), one row each: "
                          "--drafters='ngram(n=3, k=4)' --drafters='member(k=4)'")
flags.DEFINE_integer("max_new", 64, "new tokens (prompts) or bytes (bytes) per prompt")
flags.DEFINE_integer("repeats", 2, "timed rounds (best kept)")
flags.DEFINE_string("sampler", "greedy", "the sampler (brf.fusion.Sampler spec)")
flags.DEFINE_string("prompt", "List the days of the week, then list them again in reverse "
                    "order.", "the prompt")
flags.DEFINE_integer("seed", 0, "seed")
flags.DEFINE_list("engines", ["auto"], "token-level speculative engines timed side by side: "
                  "host (rounds on the host), device (rounds compiled on the device), "
                  "auto")

FIRST: dict = {}  # each row's first, untimed call: seconds (compilation included)
BORN = dict(method="born", method_params={"phase": "tanh(rate=0.5, offset=[0, 0.5])"})


def _generate_config(arg: str):
    """configs/generate.py's config for ``arg`` (its members are the cases' members)."""
    path = pathlib.Path(__file__).resolve().parent.parent / "configs" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def _drafters() -> list[str]:
    return [d.strip() for d in FLAGS.drafters if d.strip()]


def _timed(rows, repeats):
    """{label: (best seconds, result)}: each row once untimed, then timed in turn. The
    untimed call's seconds, compilation included (of what no earlier row compiled), are
    kept in FIRST."""
    for label, fn in rows:
        t0 = time.perf_counter()
        fn()
        FIRST[label] = time.perf_counter() - t0
    best = {}
    for _ in range(repeats):
        for label, fn in rows:
            t0 = time.perf_counter()
            res = fn()
            dt = time.perf_counter() - t0
            if label not in best or dt < best[label][0]:
                best[label] = (dt, res)
    return best


def _table(unit, rows, timed, plain_label, count, text, spec_of, extra=None):
    plain_s, plain_res = timed[plain_label]
    plain_rate = count(plain_res) / plain_s
    out, numbers = [], {}
    for label, _ in rows:
        s, res = timed[label]
        n = count(res)
        st = spec_of(res)
        same = "" if st is None else (
            "sampled" if not Sampler.parse(FLAGS.sampler).greedy  # the same law, not draws
            else "yes" if text(res) == text(plain_res) else "NO")
        out.append([label, n, round(FIRST[label], 1), round(s, 2), round(n / s, 2),
                    f"{n / s / plain_rate:.2f}x",
                    "" if st is None or st["acceptance"] is None else f"{st['acceptance']:.2f}",
                    "" if st is None else st["per_round"],
                    "" if st is None else st["paused"], same]
                   + ([] if extra is None else [extra[1](res)]))
        numbers[label] = n / s / plain_rate
    return markdown_table(["run", unit, "first call s", "seconds", f"{unit}/s",
                           "vs plain fused", "acceptance", f"{unit} per round",
                           "paused steps", "same text"]
                          + ([] if extra is None else [extra[0]]),
                          out), numbers


def prompts_case(drafters):
    from brf.ensemble import generate
    from brf.ensemble.run import load_members
    from brf.ensemble.speculative import generate_speculative
    members = load_members(_generate_config("prompts").members)
    prompts = [FLAGS.prompt]
    common = dict(weights=[0.5, 0.5], sampler=FLAGS.sampler, max_new_tokens=FLAGS.max_new,
                  seed=FLAGS.seed, **BORN)
    rows = [(f"one member alone ({members[0].name})",
             lambda: generate(members[:1], prompts, weights=[1.0], method="linear",
                              aligner="identity",
                              sampler=FLAGS.sampler, max_new_tokens=FLAGS.max_new,
                              seed=FLAGS.seed)),
            ("plain fused (BRF)", lambda: generate(members, prompts, aligner="identity",
                                                  **common))]
    for d in drafters:
        for engine in FLAGS.engines:
            label = f"speculative {d}" + ("" if FLAGS.engines == ["auto"] else f", {engine}")
            rows.append((label, lambda d=d, engine=engine: generate_speculative(
                members, prompts, drafter=d, engine=engine, **common)))
    timed = _timed(rows, FLAGS.repeats)
    return _table("tokens", rows, timed, "plain fused (BRF)",
                  count=lambda res: sum(g.n_events for g in res),
                  text=lambda res: [g.text for g in res],
                  spec_of=lambda res: getattr(res[0], "spec", None) and res[0].spec.summary())


def bytes_case(drafters):
    from brf.align.union import default_cache_dir
    from brf.bytes.generate import generate_bytes
    from brf.bytes.lm import ByteLM
    from brf.bytes.speculative import generate_bytes_speculative
    from brf.ensemble.run import load_members
    members = load_members(_generate_config("bytes").members)
    lms = [ByteLM(m.params, m.cfg, m.tokenizer, name=m.name, cache_dir=default_cache_dir())
           for m in members]
    contexts = [m.prompt_ids(FLAGS.prompt) for m in members]
    common = dict(weights=[0.5, 0.5], sampler=FLAGS.sampler, max_bytes=FLAGS.max_new,
                  seed=FLAGS.seed, eos_ids=[sorted(m.eos_ids()) for m in members], **BORN)
    rows = [("plain fused on bytes (BRF)", lambda: generate_bytes(lms, contexts, **common))]
    for d in drafters:
        rows.append((f"speculative {d}", lambda d=d: generate_bytes_speculative(
            lms, contexts, drafter=d, lookup=FLAGS.prompt.encode("utf-8"), **common)))
    timed = _timed(rows, FLAGS.repeats)
    forward = ("tokens run after the context (tree calls), per member",
               lambda g: " / ".join(f"{t - len(c)} ({k})"
                                    for t, c, k in zip(g.tokens, contexts, g.calls)))
    return _table("bytes", rows, timed, "plain fused on bytes (BRF)",
                  count=lambda g: len(g.data), text=lambda g: g.data,
                  spec_of=lambda g: getattr(g, "spec", None) and g.spec.summary(),
                  extra=forward)


def main(argv):
    del argv
    drafters = _drafters()
    if set(FLAGS.engines) - {"auto", "host", "device"}:
        raise UserError(f"--engines: unknown engine(s) "
                        f"{sorted(set(FLAGS.engines) - {'auto', 'host', 'device'})}; use "
                        "auto, host, device")
    unknown = set(FLAGS.cases) - {"prompts", "bytes"}
    if unknown:
        raise UserError(f"--cases: unknown case(s) {sorted(unknown)}; use prompts, bytes")
    from brf.drafting import parse_drafter
    for d in drafters:
        parse_drafter(d)  # a bad spec ends here, before any model loads
    print(f"device: {jax.devices()[0].device_kind} "
          f"({platform.processor() or platform.machine()}), sampler {FLAGS.sampler!r}, "
          f"{FLAGS.max_new} new units, prompt {FLAGS.prompt!r}\n")
    for case in FLAGS.cases:
        table, _ = (prompts_case if case == "prompts" else bytes_case)(drafters)
        print(f"### {case}\n\n{table}\n", flush=True)


if __name__ == "__main__":
    cli.run(main)
