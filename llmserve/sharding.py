"""Tensor parallelism over a device mesh, and multi-host start-up.

The mesh has two axes, ``("data", "model")``, built with ``Mesh(devices, names)`` and Auto axis
types (``jax.make_mesh`` defaults to Explicit axes, under which plain einsums of differently
sharded operands are errors instead of partitioner decisions). A data-parallel replica runs on
one row of the mesh (a ``[1, tp]`` sub-mesh, see ``data_parallel.py``); inside it the SPMD
partitioner splits the step over ``model`` from the shardings given here:

* attention heads: q/k/v projections split by output columns (whole heads), o_proj by rows;
* the MLP hidden dimension F: gate/up by columns, down by rows (one all-reduce per block
  after o_proj and one after down_proj: the Megatron pattern);
* the embedding table and the LM head: split over the vocabulary when ``tp`` divides V, else
  replicated (see ``EMBED_MODES``; experiments/sharding.py compares the HLO of both);
* the paged KV cache: split over kv heads (``kv_cache.KV_HEAD_AXIS``), so a device holds only
  its heads' pages. The cache write and the attention kernel run per shard inside
  ``shard_map``: the partitioner never sees an opaque kernel call that would make it gather the
  cache.

Head counts: ``tp`` splits the query heads N (``N % tp == 0``). If ``tp`` divides the kv heads
K, each device owns K / tp of them. If instead K divides ``tp`` (``tp > K``: 2 kv heads at
tp = 4), every kv head is *replicated* ``tp / K`` times (vLLM's rule): k/v_proj columns are
repeated so the model has K' = tp kv heads, each device owns one, and the function computed is
unchanged (each query head still reads its own kv head). Anything else is a ValueError.

Multi-host: ``initialize_distributed`` wires ``jax.distributed.initialize`` from arguments or
the environment; ``multihost.py`` sends the leader's host batches to the other processes, so
every process runs the same SPMD step (see README "Sharding").
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llmserve.config import ModelConfig

DATA, MODEL = "data", "model"
EMBED_MODES = ("vocab", "replicated")  # how the embedding table / LM head are placed


# ------------------------------------------------------------------ mesh and head counts
def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1,
              devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A ``[dp, tp]`` mesh over the first dp * tp devices, axes ("data", "model"), Auto types.

    Neighbouring devices share a ``model`` group (on a GPU host: the NVLink-connected ones).
    """
    for name, v in (("tensor_parallel_size", tensor_parallel_size),
                    ("data_parallel_size", data_parallel_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be an int >= 1")
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size="
                         f"{data_parallel_size} needs {need} devices; {len(devices)} available "
                         f"({jax.default_backend()}; on CPU set XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={need} before jax starts)")
    grid = np.array(devices[:need], dtype=object).reshape(data_parallel_size,
                                                         tensor_parallel_size)
    return Mesh(grid, (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def kv_head_plan(cfg: ModelConfig, tp: int) -> str:
    """How ``tp`` devices share cfg's heads: "split" (tp divides K) or "replicate" (K divides
    tp: each kv head copied tp / K times). Raises ValueError when neither fits."""
    n, k = cfg.n_heads, cfg.n_kv_heads
    if n % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the {n} query heads "
                         f"(use one of {[d for d in range(1, n + 1) if n % d == 0]})")
    if cfg.ffn_dim % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the MLP hidden size "
                         f"ffn_dim={cfg.ffn_dim}")
    if k % tp == 0:
        return "split"
    if tp % k == 0:
        return "replicate"
    raise ValueError(f"tensor_parallel_size={tp} neither divides the {k} kv heads (each device "
                     f"owns K/tp of them) nor is a multiple of them (each kv head replicated "
                     f"tp/K times); use a divisor or a multiple of {k}")


def expand_kv_heads(cfg: ModelConfig, params, tp: int):
    """(cfg, params) with every kv head repeated tp / K times, so K' = tp (identical outputs:
    query head i still attends with kv head i // G). A no-op unless K < tp."""
    k = cfg.n_kv_heads
    if kv_head_plan(cfg, tp) == "split":
        return cfg, params
    r, h = tp // k, cfg.head_dim

    def repeat(path, x):
        name = _path_str(path)
        if not re.search(r"attn/[kv]_proj/(kernel|bias)$", name):
            return x
        x = jnp.asarray(x)
        heads = x.reshape(*x.shape[:-1], k, h)  # [..., K, H]
        return jnp.repeat(heads, r, axis=-2).reshape(*x.shape[:-1], tp * h)

    return cfg.replace(n_kv_heads=tp), jax.tree_util.tree_map_with_path(repeat, params)


# ------------------------------------------------------------------ partition rules
def _path_str(path) -> str:
    return "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def partition_rules(embed: str = "vocab") -> tuple[tuple[str, P], ...]:
    """(regex over "a/b/c" param paths, PartitionSpec); the first match wins."""
    if embed not in EMBED_MODES:
        raise ValueError(f"embed={embed!r}: use one of {EMBED_MODES}")
    vocab = embed == "vocab"
    return (
        (r"attn/[qkv]_proj/kernel$", P(None, MODEL)),  # [D, heads*H]: whole heads per device
        (r"attn/[qkv]_proj/bias$", P(MODEL)),
        (r"attn/o_proj/kernel$", P(MODEL, None)),  # [N*H, D]: partial sums, one all-reduce
        (r"mlp/(gate|up)_proj/kernel$", P(None, MODEL)),  # [D, F]
        (r"mlp/down_proj/kernel$", P(MODEL, None)),  # [F, D]
        (r"embed/embedding$", P(MODEL, None) if vocab else P()),  # [V, D]
        (r"lm_head/kernel$", P(None, MODEL) if vocab else P()),  # [D, V]
        (r".*", P()),  # norms (and anything new): replicated
    )


def param_specs(params, cfg: ModelConfig, tp: int, embed: str = "vocab"):
    """A pytree of PartitionSpecs matching ``params`` (vocab splits fall back to replicated
    when tp does not divide V)."""
    if cfg.vocab_size % tp:
        embed = "replicated"
    rules = [(re.compile(pat), spec) for pat, spec in partition_rules(embed)]

    def spec(path, _):
        name = _path_str(path)
        return next(s for pat, s in rules if pat.search(name))

    return jax.tree_util.tree_map_with_path(spec, params)


def cache_spec(ndim: int) -> P:
    """The kv-head split of one per-layer cache array (its kv-head axis: KV_HEAD_AXIS)."""
    from llmserve.kv_cache import KV_HEAD_AXIS

    axes = [None] * ndim
    axes[KV_HEAD_AXIS] = MODEL
    while axes and axes[-1] is None:  # jit returns P('model',), not P('model', None, ...):
        axes.pop()  # the fresh cache must match the donated one, or the step compiles again
    return P(*axes)


# ------------------------------------------------------------------ per-shard attention
def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """``jax.shard_map`` (jax >= 0.6) or ``jax.experimental.shard_map`` (older), unchecked:
    the Pallas kernels carry no varying-manual-axes annotations."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy

    return legacy(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def per_kv_shard(f: Callable, mesh: Mesh) -> Callable:
    """Runs ``f(k_pages, v_pages, q, k, v, meta) -> (out, k_pages, v_pages)`` once per model
    shard: pages split over kv heads, q [1, N, heads, H] and k/v over heads, metadata whole."""
    pages = cache_spec(4)
    heads = P(None, None, MODEL, None)
    return shard_map(f, mesh, in_specs=(pages, pages, heads, heads, heads, P()),
                     out_specs=(heads, pages, pages))


# ------------------------------------------------------------------ placement
@dataclasses.dataclass(frozen=True)
class Shardings:
    """Where one engine's device state lives: its mesh (``[1, tp]`` for a DP replica) and the
    rules above. The Runner asks it to place params, cache and batches; nothing else changes."""

    mesh: Mesh
    embed: str = "vocab"

    @property
    def tp(self) -> int:
        return self.mesh.shape[MODEL]

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def multi_process(self) -> bool:
        return len({d.process_index for d in self.mesh.devices.flat}) > 1

    def prepare_model(self, cfg: ModelConfig, params):
        """(cfg, params) placed for this mesh: kv heads expanded if replicated, each weight
        put with its NamedSharding (a device receives only its shard)."""
        cfg, params = expand_kv_heads(cfg, params, self.tp)
        specs = param_specs(params, cfg, self.tp, self.embed)
        return cfg, jax.tree_util.tree_map(
            lambda x, s: _put(x, NamedSharding(self.mesh, s)), params, specs)

    def create_cache(self, cfg: ModelConfig, num_pages: int, page_size: int):
        """A zero PagedKVCache made directly in its kv-head shards (never whole on one
        device), carrying the mesh so its layers attend per shard."""
        from llmserve.kv_cache import PagedKVCache

        shard = NamedSharding(self.mesh, cache_spec(4))
        make = functools.partial(PagedKVCache.create, cfg, num_pages, page_size)
        shapes = jax.eval_shape(make)
        out = jax.jit(make, out_shardings=jax.tree_util.tree_map(lambda _: shard, shapes))()
        return out.replace(shardings=self)

    def vocab_split(self, vocab_size: int) -> bool:
        """Whether the embedding / LM head (hence the logits) are split over the vocabulary."""
        return self.embed == "vocab" and vocab_size % self.tp == 0 and self.tp > 1

    def gather_logits(self, logits, vocab_size: int):
        """Logits [..., V] whole on every device before sampling. Pinning them vocab-split
        first keeps the partitioner from gathering the LM head instead (it would, to make a
        replicated output); then one all-gather of [R, V] replaces one per vocab-wide
        reduction of the sampler (top-k, cumsum, counts)."""
        if self.vocab_split(vocab_size):
            split = P(*([None] * (logits.ndim - 1)), MODEL)
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, split))
        return jax.lax.with_sharding_constraint(logits, self.replicated)

    def replicate(self, tree):
        """Puts a pytree (numpy or jax) replicated on every device of the mesh."""
        return jax.tree_util.tree_map(lambda x: _put(x, self.replicated), tree)

    def local(self, tree):
        """A replicated device pytree as arrays this process can read (multi-host: its own
        copy), so ``jax.device_get`` works on every process."""
        if not self.multi_process:
            return tree
        return jax.tree_util.tree_map(lambda x: x.addressable_data(0), tree)


def _put(x, sharding: NamedSharding):
    """device_put that also builds arrays spanning other processes' devices (multi-host: each
    process passes the same full value and keeps its own shards)."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def engine_shardings(tensor_parallel_size: int, data_parallel_size: int = 1,
                     devices=None, embed: str = "vocab") -> list[Optional[Shardings]]:
    """One ``Shardings`` per data-parallel replica (row of the mesh); ``[None]`` when the
    engine runs on one device."""
    if tensor_parallel_size == 1 and data_parallel_size == 1:
        return [None]
    mesh = make_mesh(tensor_parallel_size, data_parallel_size, devices)
    return [Shardings(Mesh(mesh.devices[d:d + 1], mesh.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,) * 2), embed)
            for d in range(data_parallel_size)]


# ------------------------------------------------------------------ multi-host
ENV = {"coordinator_address": "LLMSERVE_COORDINATOR_ADDRESS",
       "num_processes": "LLMSERVE_NUM_PROCESSES", "process_id": "LLMSERVE_PROCESS_ID"}


def initialize_distributed(coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> bool:
    """``jax.distributed.initialize`` from arguments, else LLMSERVE_COORDINATOR_ADDRESS /
    LLMSERVE_NUM_PROCESSES / LLMSERVE_PROCESS_ID. Returns False (nothing done) when no
    coordinator is given; call it before anything touches a jax device."""
    coordinator_address = coordinator_address or os.environ.get(ENV["coordinator_address"])
    if not coordinator_address:
        return False
    if num_processes is None and os.environ.get(ENV["num_processes"]):
        num_processes = int(os.environ[ENV["num_processes"]])
    if process_id is None and os.environ.get(ENV["process_id"]):
        process_id = int(os.environ[ENV["process_id"]])
    if num_processes is None or process_id is None:
        raise ValueError(f"a coordinator address ({coordinator_address}) needs num_processes "
                         f"and process_id (flags or {ENV['num_processes']} / "
                         f"{ENV['process_id']})")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes="
                         f"{num_processes})")
    jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                               process_id=process_id)
    return True


# ------------------------------------------------------------------ HLO inspection
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")
_HLO_LINE = re.compile(r"=\s*(?P<shape>\(?[a-z0-9]+\[[^=]*?\]\S*(?:,\s*[a-z0-9]+\[[^\]]*\]\S*)*"
                       r"\)?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def hlo_collectives(hlo_text: str) -> list[dict]:
    """Every collective in a compiled (partitioned) HLO module: op, result shapes and the bytes
    of its result per device (an all-gather's output, an all-reduce's buffer)."""
    out = []
    for line in hlo_text.splitlines():
        m = _HLO_LINE.search(line)
        if m is None:
            continue
        shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
                  for dt, dims in _ARRAY.findall(m.group("shape"))]
        nbytes = sum(_BYTES.get(dt, 4) * int(np.prod(s)) for dt, s in shapes)
        if m.group(0).rstrip("(").endswith("-start") and m.group("op") == "all-gather":
            shapes, nbytes = shapes[-1:], _BYTES.get(shapes[-1][0], 4) * int(
                np.prod(shapes[-1][1]))  # async start tuples hold (operand, result)
        out.append({"op": m.group("op"), "shapes": [f"{dt}{list(s)}" for dt, s in shapes],
                    "bytes": int(nbytes)})
    return out


__all__ = ["DATA", "MODEL", "Shardings", "cache_spec", "engine_shardings", "expand_kv_heads",
           "hlo_collectives", "initialize_distributed", "kv_head_plan", "make_mesh",
           "param_specs", "partition_rules", "per_kv_shard", "shard_map"]
