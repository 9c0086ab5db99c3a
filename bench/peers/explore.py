"""`python -m bench.peers.explore [VARIANT ...]`: our step with one thing changed, alternated with the seed's.

Each variant is trainer.pretrain.train.Steps on the seed's config (L4 D256 H4 T256 B16, mesh 8x1, f32) with one
change, so its ratio to `ours` is that change's effect; measured side by side like `python -m bench`.
`dp` is ours with --vocab-parallel off; foldmask, shardmap*, zero1*, wte_t* and best change that
replicated-table step, so read them against `dp`.
Used to find what to suggest for the trainer; not part of `make bench`.
"""
from __future__ import annotations

import sys
import tempfile
import time

from bench.devices import emulate

VARIANTS = ("seed", "ours", "dp", "nopad", "foldmask", "nodropout", "noclip", "shardmap", "shardmap_fold", "zero1",
            "zero1_fold", "wte_t", "wte_t_fold", "best")


def build(name: str, tmp: str):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench import seed_gpt2
    from bench.ours import OursTrainer, config
    from trainer.pretrain import train as loop
    from trainer.models import gpt2

    model = dict(n_layer=4, d_model=256, n_head=4, seq_len=256, dropout=0.1)
    train = dict(batch_size=16, mesh="data=8,model=1", dtype="float32")
    if name == "seed":
        s = seed_gpt2.SeedTrainer(seed_gpt2.SeedConfig())
        return lambda tok: s.step(tok[:, :-1].astype(np.int64), tok[:, 1:].astype(np.int64))
    if name == "nopad":
        model["vocab_multiple"] = 1
    # dp: the tied embedding replicated, its gradient all-reduced (as before --vocab-parallel). The other
    # head/optimizer variants below were written for that replicated table: compare them with dp.
    if name == "dp" or name.startswith(("foldmask", "shardmap", "zero1", "wte_t", "best")):
        train["vocab_parallel"] = "off"
    if name == "nodropout":
        model["dropout"] = 0.0
    if name == "noclip":
        train["grad_clip"] = 0.0
    cfg = config("gpt2-tiny", f"{tmp}/{name}", model=model, train=train)

    class FoldMask(loop.Steps):
        """Raw padded logits out of the model; the padding mask applied inside the loss's reductions."""

        def _loss(self, params, tokens, key):
            import dataclasses
            m = nnx.merge(self.graphdef, params)
            c = m.cfg
            m.cfg = dataclasses.replace(c, vocab_size=c.padded_vocab)  # the model then skips its where()
            logits = m(tokens[:, :-1], dropout_key=key, dtype=self.dtype)
            valid = jnp.arange(c.padded_vocab) < c.vocab_size
            logz = jax.nn.logsumexp(jnp.where(valid, logits, -jnp.inf), axis=-1)
            picked = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
            return jnp.mean(logz - picked)

    from jax.sharding import PartitionSpec as P

    def shard_mapped(base):
        class ShardMapDP(base):
            """Data parallel by hand: local loss + grads per `data` shard (both uses of the tied embedding
            summed locally by autodiff), then ONE pmean of the grads; optimizer as in loop.Steps."""

            def _train_step(self, params, opt_state, batch, step):
                import optax
                t = self.cfg.train
                key = jax.random.fold_in(jax.random.key(t.seed), step)

                def local(params, batch, key):
                    k = jax.random.fold_in(key, jax.lax.axis_index("data"))
                    loss, grads = jax.value_and_grad(self._loss)(params, batch, k)
                    return jax.lax.pmean(loss, "data"), jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)

                saved = gpt2.constrain
                gpt2.constrain = lambda x, axes: x  # no sharding constraints inside a manual region
                try:
                    loss, grads = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P("data", None), P()),
                                                out_specs=(P(), P()), check_vma=False)(params, batch, key)
                finally:
                    gpt2.constrain = saved
                grad_norm = optax.global_norm(grads)
                updates, opt_state = self.tx.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
                return params, opt_state, {"loss": loss, "grad_norm": grad_norm, "lr": self.lr(step - 1)}
        return ShardMapDP

    from jax.sharding import NamedSharding

    def zero1(base):
        class Zero1(base):
            """Adam moments sharded over `data` too (params stay replicated): each device updates 1/8."""

            def __init__(self, cfg, mesh):
                super().__init__(cfg, mesh)
                d = mesh.shape["data"]

                def over_data(sh, a):
                    spec = list(sh.spec) + [None] * (len(a.shape) - len(sh.spec))
                    for i, n in enumerate(a.shape):
                        if spec[i] is None and n % d == 0:
                            spec[i] = "data"
                            return NamedSharding(mesh, P(*spec))
                    return sh
                shapes = jax.eval_shape(self.tx.init, self.abstract_params)
                self.opt_sh = jax.tree.map(over_data, self.opt_sh, shapes)
                self.abstract_opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                                 shapes, self.opt_sh)
                self._train = jax.jit(self._train_step,
                                      in_shardings=(self.param_sh, self.opt_sh, self.batch_sh, self.rep),
                                      out_shardings=(self.param_sh, self.opt_sh, self.rep), donate_argnums=(0, 1))
        return Zero1

    class GPT2T(gpt2.GPT2):
        """The tied embedding stored (embed, vocab): the head is x @ W with W in its natural layout, so
        the backward's dW = x^T g transposes the small x, not the [tokens, vocab] cotangent."""

        def __init__(self, cfg, rngs):
            super().__init__(cfg, rngs)
            self.wte = nnx.Param(self.wte[...].T, axes=("embed", "vocab"))

        def __call__(self, tokens, **kw):
            wt = self.wte
            self.wte = nnx.Param(wt[...].T, axes=("vocab", "embed"))  # the model's code, unchanged, on W^T^T
            try:
                return super().__call__(tokens, **kw)
            finally:
                self.wte = wt

    if name in ("wte_t", "wte_t_fold", "best"):
        gpt2.GPT2 = GPT2T  # module global: abstract(), init_params() and loop's eval_shape all build this

    cls = {"foldmask": FoldMask, "wte_t": loop.Steps, "wte_t_fold": FoldMask, "best": shard_mapped(FoldMask), "zero1": zero1(loop.Steps), "zero1_fold": zero1(FoldMask), "shardmap": shard_mapped(loop.Steps),
           "shardmap_fold": shard_mapped(FoldMask)}.get(name, loop.Steps)
    orig, orig_model = loop.Steps, GPT2T.__mro__[1]
    loop.Steps = cls
    try:
        tr = OursTrainer(cfg)
    finally:
        loop.Steps, gpt2.GPT2 = orig, orig_model
    return tr.step


def main(argv: list[str]) -> int:
    emulate(8)
    import numpy as np

    from bench.peers.peak import median
    from bench.run import alternate

    rounds = 6
    if argv and argv[0].isdigit():
        rounds, argv = int(argv[0]), argv[1:]
    names = argv or ["seed", "ours", "nopad", "foldmask"]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        print(f"error: unknown variant {bad[0]!r}: choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    tok = rng.integers(0, 50257, (16, 257), dtype=np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        runners = {}
        for n in names:
            t0 = time.perf_counter()
            f = build(n, tmp)
            f(tok)
            f(tok)
            runners[n] = (lambda f=f: f(tok))
            print(f"{n}: built + 2 warm-up steps in {time.perf_counter() - t0:.0f} s", flush=True)
        tm = alternate(runners, rounds, 1)
    for n in tm.wall:
        rel = ""
        if "ours" in tm.wall:
            rel = (f"  speed vs ours: wall {median(tm.round_ratio('ours', n)):.2f}x, "
                   f"CPU {median(tm.round_ratio('ours', n, 'cpu')):.2f}x (per-round medians)")
        print(f"{n:14s} step {median(tm.wall[n]):.3f} s, {median(tm.cpu[n]):.2f} CPU-s "
              f"[{' '.join(f'{t:.1f}' for t in tm.wall[n])}]{rel}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
