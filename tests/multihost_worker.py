"""One process of the multi-process study test (tests/test_sharding.py).

    python tests/multihost_worker.py TMP single
    python tests/multihost_worker.py TMP multi COORDINATOR NUM_PROCESSES PROCESS_ID

Runs the study (brf.eval.study.run: two pooled corpora, the prompt study with
its prefix pair, same-model pair and swarm, the event-space check) on two tiny
random members (BPE tokenizers trained on the corpus, as in
tests/test_validate.py), writing into TMP/single or TMP/multi. With 'multi' the
process joins a ``jax.distributed`` run (config.distributed) and scores its
share of every scoring. The test gives each process two virtual devices.
"""

import os
import pathlib
import sys

HERE = pathlib.Path(__file__).parent


def main(tmp: str, mode: str, *dist: str) -> None:
    from test_validate import tiny_members, validate_config  # noqa: E402

    import jax

    from brf.eval import plan as plan_lib, scorer, study
    from brf.eval.corpus import load_default_corpus

    corpus = os.path.join(tmp, "corpus.txt")
    if mode == "single":
        with open(corpus, "w", encoding="utf-8") as f:
            f.write(load_default_corpus(min_chars=100)[:3200])
    text = open(corpus, encoding="utf-8").read()
    half = len(text) // 2
    c = validate_config.get_config("short")
    c.members = "tiny-a, tiny-b"
    c.corpora = (f'{corpus}(label="first", max_chars={half}, prefix="A story.\\n\\n"), '
                 f'{corpus}(label="second", skip_chars={half})')
    c.scoring.min_chars = 1000
    c.prompts.second_prefix = "Text:\n"
    c.prompts.swarm = True
    c.topk_sensitivity = 16
    c.bottleneck.positions = 0
    c.scoring.segment_chars = 400
    c.scoring.top_k = 8
    c.scoring.chunk = 64
    c.fit.max_iter = 20
    c.stats.n_perm = 50
    c.stats.n_boot = 50
    c.out_dir = os.path.join(tmp, mode)
    c.methods = 'linear(label="linear (tuned)")'
    c.phase_maps = ('constant(label="hellinger (equal phases)", fixed=True), '
                    'constant(label="linear pool (pi/2)", offset=[0, pi/2], fixed=True), tanh')
    c.variants = c.prompts.variants = "proposed"
    c.sweep = c.sweep[:1]
    c.mesh.placement = "apart"
    if mode == "multi":
        addr, n, pid = dist
        c.distributed.enabled = True
        c.distributed.coordinator_address = addr
        c.distributed.num_processes = int(n)
        c.distributed.process_id = int(pid)
        # Join before any JAX computation (building the members below runs JAX).
        from brf import sharding
        sharding.initialize_distributed(c.distributed)

    # The three processes of the test share compiled executables (compile time
    # is most of this run).
    from brf.runtime import enable_compilation_cache
    enable_compilation_cache(os.path.join(tmp, "jax_cache"))

    members = tiny_members(text)
    plan = plan_lib.from_config(c)
    meshes = scorer.member_meshes(plan.mesh, len(plan.members))
    assert [[d.id for d in m.devices.flat] for m in meshes] == [
        [d.id for d in jax.local_devices()[:1]], [d.id for d in jax.local_devices()[1:2]]], meshes
    rep = study.run(plan, load_model=members.__getitem__)
    print("report written" if rep is not None else "share scored", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main(*sys.argv[1:])
