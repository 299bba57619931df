"""Tensor / data parallelism on 8 fake CPU devices: same tokens as one device, no gathers.

jax reads ``--xla_force_host_platform_device_count`` only when its backend starts, and a pytest
worker has usually started it already, so the scenarios run in one fresh subprocess
(``python -m tests.test_sharding tp2 tp3 ...``) that prints one JSON line; the tests assert on it.
The oracle is the single-device engine on the same workload (itself checked against the
reference generate loop in test_engine.py).

Tolerances (float32 tiny models): a sequence's greedy tokens must match the single-device run
up to the first position where the single-device top-2 logprob gap is below ``GAP`` (a near-tie
that reduction order may flip); the chosen tokens' logprobs agree within ``LOGPROB_TOL``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

GAP = 1e-5  # 20x the largest logprob difference seen (5e-7)
LOGPROB_TOL = 1e-5
ENGINE = dict(max_model_len=64, max_num_seqs=8, page_size=16, max_num_batched_tokens=16,
              prefill_buckets=((4, 16),), decode_buckets=(8,), max_logprobs=2)


# ------------------------------------------------------------------ subprocess side
def _workload(cfg, n, seed, shared_prefix=0):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(1, cfg.vocab_size, shared_prefix).tolist()
    prompts = [prefix + rng.integers(1, cfg.vocab_size, rng.integers(2, 20)).tolist()
               for _ in range(n)]
    lens = rng.integers(4, 16, n).tolist()
    return prompts, lens


def _serve(eng, prompts, lens):
    from llmserve.sampling_params import SamplingParams

    for i, (p, n) in enumerate(zip(prompts, lens)):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                  logprobs=2))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    cached = sum(o.metrics.num_cached_tokens or 0 for o in outs.values())
    return [outs[str(i)].outputs[0] for i in range(len(prompts))], cached


def _compare(want, got) -> dict:
    """Tokens equal up to each sequence's first near-tie; max logprob difference there."""
    compared = total = 0
    diff = 0.0
    mismatch = []
    for i, (w, g) in enumerate(zip(want, got)):
        total += len(w.token_ids)
        for j, tok in enumerate(w.token_ids):
            top = sorted(w.logprobs[j].values(), reverse=True)
            if len(top) > 1 and top[0] - top[1] < GAP:
                break
            if j >= len(g.token_ids) or g.token_ids[j] != tok:
                mismatch.append((i, j))
                break
            diff = max(diff, abs(w.logprobs[j][tok] - g.logprobs[j][tok]))
            compared += 1
    return {"mismatch": mismatch, "compared": compared, "total": total, "logprob_diff": diff}


def _gathers(runner) -> dict:
    """All-gathers in the compiled decode step, and the logits shape they may legitimately
    hold (rows x vocab); the other collectives by kind."""
    from llmserve.sharding import hlo_collectives

    text = runner.lower_step(runner.empty_batch((8, None, 1))).compile().as_text()
    coll = hlo_collectives(text)
    return {"all_gather_shapes": [c["shapes"] for c in coll if c["op"] == "all-gather"],
            "ops": sorted({c["op"] for c in coll}),
            "num": len(coll)}


def _engine(cfg, params, **kw):
    from llmserve.data_parallel import make_engine
    from llmserve.engine import EngineConfig

    eng = make_engine(cfg, params, None, EngineConfig(**{**ENGINE, **kw}))
    eng.warmup()
    return eng


def scenario(name: str) -> dict:
    """Runs one named check in this (fresh) process; returns what the tests assert on."""
    import jax

    from llmserve.config import preset
    from llmserve.model import init_params

    assert jax.device_count() >= 8, jax.devices()
    # tiny-gqa scenarios share one single-device baseline (10 pages of 16: preemptions happen)
    model, kw, n, prefix = {
        # prefix caching + preemption at TP=2 (kv heads split)
        "tp2": ("tiny-gqa", dict(tensor_parallel_size=2, num_pages=10), 16, 20),
        # SmolLM2-shaped 9 q / 3 kv heads at TP=3, with draft-model speculative decoding
        "tp3": ("tiny-9-3", dict(tensor_parallel_size=3, speculative_config={
            "method": "draft", "num_speculative_tokens": 2, "adaptive": False}), 12, 0),
        # 2 kv heads over 4 devices: each kv head replicated twice; the Pallas kernel
        # (interpret mode) runs per shard inside shard_map
        "tp4": ("tiny-gqa", dict(tensor_parallel_size=4, num_pages=10,
                                 backend="pallas_interpret"), 12, 0),
        # replica 0 shares the tp2 mesh (devices 0, 1), so only replica 1 compiles anew
        "dp2tp2": ("tiny-gqa", dict(tensor_parallel_size=2, data_parallel_size=2,
                                    num_pages=10), 24, 0),
    }[name]
    cfg = preset(model)
    params = init_params(cfg, seed=3)
    if "speculative_config" in kw:
        kw["speculative_config"]["model"] = (cfg, params)
    prompts, lens = _workload(cfg, n, seed=7, shared_prefix=prefix)
    base = {k: v for k, v in kw.items() if k == "num_pages"}
    want, _ = _serve(_engine(cfg, params, **base), prompts, lens)
    eng = _engine(cfg, params, **kw)
    compiles = eng.runner.num_compilations()
    got, cached = _serve(eng, prompts, lens)
    replicas = getattr(eng, "replicas", [eng])
    out = {"compare": _compare(want, got), "tp": kw["tensor_parallel_size"],
           "recompiled": eng.runner.num_compilations() - compiles,
           "all_free": all(e.blocks.all_free() for e in replicas),
           "stats": eng.stats, "vocab": cfg.vocab_size, "cached_tokens": cached,
           "cache_sharding": str(replicas[0].runner.cache.k[0].sharding.spec),
           "cache_shard_shape": list(replicas[0].runner.cache.k[0].addressable_shards[0]
                                     .data.shape),
           "replica_devices": [sorted(d.id for d in e.runner.cache.k[0].devices())
                               for e in replicas],
           "replica_requests": [e._counter for e in replicas],
           **_gathers(replicas[0].runner)}
    return out


def multihost_process() -> dict:
    """One of two processes (2 CPU devices each) serving tiny-gqa at TP=4 over both.

    jax.distributed is initialized from LLMSERVE_* environment variables. Process 0 runs the
    engine (and a single-device engine as the oracle); process 1 follows its device calls.
    """
    from llmserve.sharding import initialize_distributed

    assert initialize_distributed()
    import jax

    from llmserve.config import preset
    from llmserve.engine import Engine, EngineConfig
    from llmserve.model import init_params
    from llmserve.multihost import follow

    cfg = preset("tiny-gqa")
    params = init_params(cfg, seed=3)
    config = EngineConfig(**ENGINE, tensor_parallel_size=4)
    eng = Engine(cfg, params, None, config)  # every process builds the same engine
    if jax.process_index() != 0:
        return {"follower_calls": follow(eng.runner)}
    prompts, lens = _workload(cfg, 8, seed=11, shared_prefix=4)
    eng.warmup()
    compiles = eng.runner.num_compilations()
    got, _ = _serve(eng, prompts, lens)
    recompiled = eng.runner.num_compilations() - compiles
    eng.runner.stop_followers()
    want, _ = _serve(_engine(cfg, params), prompts, lens)  # one local device
    return {"compare": _compare(want, got), "recompiled": recompiled,
            "process_count": jax.process_count(), "devices": jax.device_count(),
            "mesh_processes": sorted({d.process_index
                                      for d in eng.runner.cache.k[0].devices()})}


# ------------------------------------------------------------------ pytest side
SCENARIOS = ("tp2", "tp3", "tp4", "dp2tp2")


def run_scenarios(names, timeout: int = 900) -> dict:
    """Runs ``scenario(name)`` for each name in ONE subprocess with 8 CPU devices (scenarios
    of one model share its compiled single-device baseline); returns {name: result}."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests.test_sharding", *names], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results():
    return run_scenarios(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_same_tokens_as_one_device(results, name):
    c = results[name]["compare"]
    assert c["mismatch"] == [], c
    assert c["compared"] >= 0.9 * c["total"], c  # near-ties are rare: most tokens compared
    assert c["logprob_diff"] < LOGPROB_TOL, c


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_gather_of_cache_or_weights_and_no_recompile(results, name):
    r = results[name]
    assert r["recompiled"] == 0
    assert r["all_free"]
    # The only all-gather: the [1, R=8, V] logits before sampling (vocab-split LM head);
    # never the KV cache or a weight matrix.
    for shapes in r["all_gather_shapes"]:
        assert shapes == [f"f32[1, 8, {r['vocab']}]"], r["all_gather_shapes"]
    assert len(r["all_gather_shapes"]) == (0 if r["vocab"] % r["tp"] else 1)


@pytest.mark.parametrize("name", SCENARIOS)
def test_cache_split_over_kv_heads_and_features(results, name):
    r = results[name]
    assert r["cache_sharding"] == "P('model',)"
    assert r["cache_shard_shape"][0] == 1  # 2 kv heads / 2, 3 / 3, 2 repeated to 4 / 4
    if name == "tp2":
        assert r["stats"]["preemptions"] > 0  # the small pool forced preemptions
        assert r["cached_tokens"] > 0  # the shared prefix was served from cached pages
    if name == "tp3":
        assert r["stats"]["spec_accepted"] == r["stats"]["spec_proposed"] > 0
    if name == "dp2tp2":
        assert r["replica_devices"] == [[0, 1], [2, 3]]
        assert all(n > 0 for n in r["replica_requests"])  # both replicas served requests


def test_two_processes_with_jax_distributed():
    """Two CPU processes (jax.distributed over gloo) serve one TP=4 engine: the leader's
    tokens equal the single-device run, and the follower ran every broadcast call."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    for pid in range(2):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   JAX_PLATFORMS="cpu", LLMSERVE_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   LLMSERVE_NUM_PROCESSES="2", LLMSERVE_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.test_sharding",
                                       "--multihost"], cwd=root, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    leader, follower = outs
    assert leader["process_count"] == 2 and leader["devices"] == 4
    assert leader["mesh_processes"] == [0, 1]  # the KV cache spans both processes
    c = leader["compare"]
    assert c["mismatch"] == [] and c["compared"] >= 0.9 * c["total"], c
    assert c["logprob_diff"] < LOGPROB_TOL, c
    assert leader["recompiled"] == 0
    assert follower["follower_calls"] > 0


# ------------------------------------------------------------------ in-process, one device
def test_head_count_rules_and_errors():
    from llmserve.config import preset
    from llmserve.sharding import kv_head_plan

    assert kv_head_plan(preset("tiny-9-3"), 3) == "split"  # SmolLM2's heads: 1 kv head each
    assert kv_head_plan(preset("tiny-gqa"), 2) == "split"
    assert kv_head_plan(preset("tiny-gqa"), 4) == "replicate"  # 2 kv heads, each on 2 devices
    with pytest.raises(ValueError, match="must divide the 9 query heads"):
        kv_head_plan(preset("tiny-9-3"), 2)
    with pytest.raises(ValueError, match="ffn_dim=1536"):
        kv_head_plan(preset("smollm2-135m"), 9)
    odd = preset("tiny-gqa").replace(n_heads=12, n_kv_heads=4, ffn_dim=96)
    with pytest.raises(ValueError, match="neither divides the 4 kv heads"):
        kv_head_plan(odd, 6)


def test_replicated_kv_heads_compute_the_same_model():
    """Repeating each kv head tp/K times (K' = tp) leaves the function unchanged: the
    reference generate loop gives the same greedy tokens and near-equal logits."""
    import jax.numpy as jnp

    from llmserve.config import preset
    from llmserve.model import init_params
    from llmserve.reference import generate_reference
    from llmserve.sharding import expand_kv_heads

    cfg = preset("tiny-gqa")
    params = init_params(cfg, seed=3)
    cfg4, params4 = expand_kv_heads(cfg, params, 4)
    assert cfg4.n_kv_heads == 4
    k = params4["layers_0"]["attn"]["k_proj"]["kernel"].reshape(cfg.d_model, 4, cfg.head_dim)
    assert jnp.array_equal(k[:, 0], k[:, 1]) and jnp.array_equal(k[:, 2], k[:, 3])
    prompts = [[5, 9, 200, 17], [3, 1, 4, 1, 5, 9, 2, 6]]
    assert generate_reference(params4, cfg4, prompts, 8) == generate_reference(
        params, cfg, prompts, 8)


def test_bad_parallel_sizes_raise_before_anything_is_built():
    from llmserve.config import preset
    from llmserve.engine import Engine, EngineConfig
    from llmserve.sharding import make_mesh

    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig(tensor_parallel_size=0).validate()
    with pytest.raises(TypeError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=True).validate()
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh(64)
    with pytest.raises(ValueError, match="must divide the 9 query heads"):
        Engine(preset("tiny-9-3"), {}, None, EngineConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="DataParallelEngine"):
        Engine(preset("tiny-9-3"), {}, None, EngineConfig(data_parallel_size=2))


def test_hlo_collectives_parses_sync_and_async_forms():
    from llmserve.sharding import hlo_collectives

    text = """
  %all-reduce.3 = f32[1,8,64]{2,1,0} all-reduce(%x), channel_id=2, replica_groups={{0,1}}
  %ag = (bf16[4,16]{1,0}, bf16[8,16]{1,0}) all-gather-start(%y), dimensions={0}
  %p = f32[2]{0} add(%a, %b)
"""
    got = hlo_collectives(text)
    assert got == [{"op": "all-reduce", "shapes": ["f32[1, 8, 64]"], "bytes": 2048},
                   {"op": "all-gather", "shapes": ["bf16[8, 16]"], "bytes": 256}]


if __name__ == "__main__":
    if sys.argv[1:] == ["--multihost"]:
        print(json.dumps(multihost_process(), default=str))
    else:
        print(json.dumps({name: scenario(name) for name in sys.argv[1:]}, default=str))
