"""The models as `flax.nnx` modules, one class per family (`Llama`, `Gemma3`, ...:
``brf.models.ARCHITECTURES[arch].module``), run by the functional engine.

A module holds a model's parameters as `nnx.Param`s under the names of the
params pytree (notes/MODEL_CONTRACT.md), in either of its two layouts, and its
entry points hand that pytree to the functions of `brf.models.transformer`:
the same jitted pieces that `prefill` / `decode_step` run. Module and
functional path therefore compute the same logits, and a module decodes at
the functional path's speed (BENCHMARKS.md, "Flax modules").

The mapping between ``nnx.state(model, nnx.Param)`` and the params pytree
(``model.to_params()`` returns the pytree; ``Llama(cfg, params=p)`` wraps one,
sharing its buffers):

* top level: ``state['embed']``, ``state['final_norm']`` and, for an untied
  head, ``state['lm_head']`` are ``params['embed']``, ... ;
* layout 'layers' (what `brf.checkpoints.registry.load` returns):
  ``state['layers'][i][name]`` is ``params['layers'][i][name]`` (``layers`` is
  an `nnx.List` of `Block`s; names ``attn_norm``, ``wqkv_t``, ``wo_t``,
  ``mlp_norm``, ``w_gate_up_t``, ``w_down_t`` and, where the config has them,
  ``bqkv`` (q/k/v biases), ``q_norm``, ``k_norm`` (q/k norms),
  ``post_attn_norm``, ``post_mlp_norm`` (norms after attention and the MLP;
  with ``norm_placement='post'`` there is no ``attn_norm`` / ``mlp_norm``);
* layout 'stacked' (as checkpoints store it): ``state['layers'][name]`` is
  ``params['layers'][name]``, every layer on a leading [L] axis (``layers`` is
  one `Block`); names ``wq``, ``wk``, ``wv``, ``wo``, ``w_gate``, ``w_up``,
  ``w_down`` and the norms.

`brf.models.transformer.stack_layers` / `unstack_layers` convert between the
two layouts, so ``stack_layers(model.to_params(), cfg)`` is the checkpoint's
pytree for either. Training differentiates through the same engine:
`next_token_nll` is a loss and `train_step` one optax step through an
`nnx.Optimizer` (`make_optimizer` makes one).
"""

from __future__ import annotations

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from brf.models import cache as cache_lib
from brf.models import scoring
from brf.models import transformer as tr
from brf.models.config import ModelConfig


class Block(nnx.Module):
    """The parameters of one decoder layer, or of every layer stacked on a leading [L] axis.

    Attribute names are the params pytree's per-layer keys (module docstring);
    the layer's computation is the engine's (`brf.models.transformer`).
    """

    def __init__(self, arrays: dict):
        self._names = tuple(arrays)
        for name, a in arrays.items():
            setattr(self, name, nnx.Param(a))

    def arrays(self) -> dict:
        """{name: array} of this block's parameters, in the params pytree's layout."""
        return _arrays(self, self._names)


def _arrays(module: nnx.Module, names) -> dict:
    """The arrays of the `nnx.Param` attributes `names` of `module`.

    Read on every call of a module's entry points, so kept cheap: the attribute
    dict directly, and a plain array (or tracer) taken as it is stored
    (`Variable.get_value` copies it through a tree map, about 15 us a
    parameter, a few ms a decoding step over 30 layers); array refs go
    through `get_value`.
    """
    attrs = vars(module)
    out = {}
    for name in names:
        raw = attrs[name].get_raw_value()
        out[name] = raw if isinstance(raw, jax.Array) else attrs[name].get_value()
    return out


def _want_shapes(cfg: ModelConfig, stacked: bool) -> dict:
    """The params pytree's leaf shapes for `cfg` in one layout."""
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), tr.param_shapes(cfg),
                          is_leaf=lambda s: isinstance(s, tuple))
    return shapes if stacked else jax.eval_shape(tr.unstack_layers, shapes)


def check_params(cfg: ModelConfig, params: dict) -> None:
    """Raises ValueError naming the first parameter that `cfg` does not expect
    (a missing or extra name, or a wrong shape), in either layout."""
    want = _want_shapes(cfg, not tr.is_unstacked(params))
    got_leaves = dict(jax.tree_util.tree_leaves_with_path(params))
    want_leaves = dict(jax.tree_util.tree_leaves_with_path(want))
    for path in sorted(set(got_leaves) | set(want_leaves), key=str):
        name = jax.tree_util.keystr(path)
        if path not in want_leaves:
            raise ValueError(f"parameter {name} is not one of a {cfg.arch} model's")
        if path not in got_leaves:
            raise ValueError(f"parameter {name} is missing")
        if tuple(np.shape(got_leaves[path])) != want_leaves[path].shape:
            raise ValueError(f"parameter {name} has shape {np.shape(got_leaves[path])}; "
                             f"the config gives {want_leaves[path].shape}")


class Transformer(nnx.Module):
    """A decoder-only transformer as an nnx module; use the family classes
    (`Llama`, `Gemma3`, `Qwen2`, ...; `from_params` picks one by ``cfg.arch``).

    Args:
        cfg: the architecture; ``cfg.arch`` must be the class's family.
        params: a params pytree in either layout (its arrays become the
            module's `nnx.Param`s as they are, on their devices), or None to
            draw random ones from ``rngs``.
        rngs: `nnx.Rngs` for random parameters (std 0.02, norm scales 1).
        layout: the layout of random parameters, 'layers' or 'stacked'
            (``params`` brings its own).
        dtype: compute dtype (default: the parameters' dtype); norms, softmax
            and RoPE run in float32 whatever it is.
    """

    ARCH = ""

    def __init__(self, cfg: ModelConfig, *, params: dict | None = None,
                 rngs: nnx.Rngs | None = None, layout: str = "layers", dtype=None):
        if cfg.arch != self.ARCH:
            raise ValueError(f"{type(self).__name__} is the {self.ARCH!r} family; "
                             f"cfg.arch is {cfg.arch!r} (from_params picks the class)")
        if (params is None) == (rngs is None):
            raise ValueError("give exactly one of params (a pytree) and rngs (random init)")
        if params is None:
            if layout not in ("layers", "stacked"):
                raise ValueError(f"layout={layout!r}; use 'layers' or 'stacked'")
            params = tr.init_params(cfg, rngs.params())
            params = tr.unstack_layers(params) if layout == "layers" else params
        check_params(cfg, params)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype or params["embed"].dtype)
        self._names = tuple(k for k in params if k != "layers")
        for name in self._names:
            setattr(self, name, nnx.Param(params[name]))
        layers = params["layers"]
        self.layers = (nnx.List([Block(lp) for lp in layers]) if tr.is_unstacked(params)
                       else Block(layers))

    @property
    def layout(self) -> str:
        """'layers' (one `Block` per layer) or 'stacked' (one `Block` of [L, ...] arrays)."""
        return "stacked" if isinstance(self.layers, Block) else "layers"

    def to_params(self) -> dict:
        """The params pytree these parameters are (the module docstring's mapping)."""
        layers = (self.layers.arrays() if isinstance(self.layers, Block)
                  else tuple(b.arrays() for b in self.layers))
        return {**_arrays(self, self._names), "layers": layers}

    def __call__(self, tokens_BxT, valid_BxT=None, *, logits: str = "all"):
        """Logits of a stateless forward pass (`prefill` without a cache).

        Args:
            tokens_BxT: int token ids.
            valid_BxT: bool mask of real tokens (padding anywhere), or None.
            logits: 'all' -> logits_BxTxV, 'last' -> logits_BxV at each
                sequence's last valid token.

        Returns:
            float32 logits.
        """
        return self.prefill(tokens_BxT, valid_BxT, None, logits=logits)[0]

    def init_cache(self, batch: int, max_len: int, dtype=None) -> dict:
        """An empty KV cache (`brf.models.cache.init_cache`; default dtype: compute dtype)."""
        return cache_lib.init_cache(self.cfg, batch, max_len, dtype or self.dtype)

    def prefill(self, tokens_BxT, valid_BxT=None, cache=None, *, logits: str = "all",
                donate: bool = False):
        """`brf.models.prefill` on this module's parameters: (logits, cache).

        ``donate=True`` updates the cache in place (`prefill_donated`; the cache
        passed in is invalidated), which decoding wants.
        """
        run = tr.prefill_donated if donate else tr.prefill
        return run(self.to_params(), self.cfg, tokens_BxT, valid_BxT, cache, dtype=self.dtype,
                   logits=logits)

    def decode_step(self, token_B, cache, valid_B=None, *, donate: bool = False):
        """`brf.models.decode_step` on this module's parameters: (logits_BxV, cache)."""
        run = tr.decode_step_donated if donate else tr.decode_step
        return run(self.to_params(), self.cfg, token_B, cache, valid_B, dtype=self.dtype)

    def score_tokens(self, tokens_BxN, valid_BxN=None, *, chunk: int = 256, mesh=None):
        """`brf.models.score_tokens`: log p of each next token, chunk by chunk (NumPy)."""
        return scoring.score_tokens(self.to_params(), self.cfg, tokens_BxN, valid_BxN,
                                    chunk=chunk, dtype=self.dtype, mesh=mesh)


class Llama(Transformer):
    """The Llama family (SmolLM2, Llama 2/3): GQA, RoPE with optional linear /
    llama3 scaling, SiLU-gated MLP, tied or untied head."""

    ARCH = "llama"


class Mistral(Transformer):
    """Mistral: Llama's layers, every layer attending within ``sliding_window``
    when the checkpoint sets one (v0.1), else globally."""

    ARCH = "mistral"


class Qwen2(Transformer):
    """Qwen2 / Qwen2.5: Llama's layers with biases on the q, k and v projections."""

    ARCH = "qwen2"


class Qwen3(Transformer):
    """Qwen3 (dense): Llama's layers with an RMSNorm on each query and key head
    before RoPE."""

    ARCH = "qwen3"


class Phi3(Transformer):
    """Phi-3 / Phi-4: Llama's layers; the checkpoint's fused qkv and gate/up
    projections are split on reading; a sliding window where set."""

    ARCH = "phi3"


class Gemma2(Transformer):
    """Gemma 2: alternating local / global layers, norms before and after
    attention and the MLP, soft-capped attention scores and logits."""

    ARCH = "gemma2"


class Olmo2(Transformer):
    """OLMo 2: norms after attention and the MLP only, and RMSNorms over all
    query and key features before RoPE."""

    ARCH = "olmo2"


class Gemma3(Transformer):
    """Gemma 3: sliding-window and global layers with their own RoPE bases, q/k
    norms, norms after attention and MLP, GELU-gated MLP, scaled embeddings."""

    ARCH = "gemma3"


def from_params(cfg: ModelConfig, params: dict, dtype=None) -> Transformer:
    """The family module (`brf.models.ARCHITECTURES[cfg.arch].module`) over `params`."""
    from brf.models import ARCHITECTURES
    return ARCHITECTURES.get(cfg.arch).module(cfg, params=params, dtype=dtype)


def next_token_nll(model: Transformer, tokens_BxN, valid_BxN=None):
    """Mean negative log-likelihood (nats) of every next token, teacher-forced.

    The loss to fine-tune on: position t predicts token t + 1; pairs with a
    padding token on either side do not count.

    Args:
        model: the module.
        tokens_BxN: int token ids.
        valid_BxN: bool mask of real tokens, or None (all real).

    Returns:
        A float32 scalar.
    """
    tokens_BxN = jnp.asarray(tokens_BxN)
    valid_BxN = (jnp.ones(tokens_BxN.shape, bool) if valid_BxN is None
                 else jnp.asarray(valid_BxN, bool))
    logp_BxNxV = jax.nn.log_softmax(model(tokens_BxN, valid_BxN), axis=-1)
    gold_BxM = jnp.take_along_axis(logp_BxNxV[:, :-1], tokens_BxN[:, 1:, None], axis=-1)[..., 0]
    counted_BxM = valid_BxN[:, :-1] & valid_BxN[:, 1:]
    return -jnp.sum(jnp.where(counted_BxM, gold_BxM, 0.0)) / jnp.maximum(counted_BxM.sum(), 1)


def make_optimizer(model: Transformer, tx) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)``, its scalar state placed beside the parameters.

    nnx creates the step counters (the optimizer's and e.g. adam's) on no
    particular device; after one `train_step` they sit on the parameters'
    device, and that change of placement compiles the step a second time.
    Placing them up front compiles it once.

    Args:
        model: the module to train (every `nnx.Param`).
        tx: an optax gradient transformation, e.g. ``optax.adam(1e-4)``.
    """
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    where = model.embed.get_raw_value().sharding
    if isinstance(where, jax.sharding.NamedSharding):  # a mesh: counters on every device
        where = jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec())
    state = nnx.state(opt)
    nnx.update(opt, jax.tree.map(lambda x: jax.device_put(x, where) if x.ndim == 0 else x,
                                 state))
    return opt


@nnx.jit
def train_step(model: Transformer, optimizer: nnx.Optimizer, tokens_BxN, valid_BxN=None):
    """One optimizer step on `next_token_nll`; updates model and optimizer in place.

    Args:
        model: the module.
        optimizer: ``nnx.Optimizer(model, optax_transform, wrt=nnx.Param)``
            (`make_optimizer` makes one that compiles this step once).
        tokens_BxN, valid_BxN: the batch (see `next_token_nll`).

    Returns:
        The loss before the step.
    """
    loss, grads = nnx.value_and_grad(next_token_nll)(model, tokens_BxN, valid_BxN)
    optimizer.update(model, grads)
    return loss


__all__ = ["Block", "Gemma2", "Gemma3", "Llama", "Mistral", "Olmo2", "Phi3", "Qwen2", "Qwen3",
           "Transformer", "check_params", "from_params", "make_optimizer", "next_token_nll",
           "train_step"]
