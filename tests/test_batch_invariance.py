"""Bitwise batch invariance (``batch_invariant=True``): a request's token ids and logprobs are
identical alone, beside 7 / 31 / 63 co-tenants, after a prefix-cache hit, under another chunk
split, after preemption and recompute, and (greedy) with speculation, in fp32 and bf16."""

import numpy as np
import pytest

from llmserve.config import preset
from llmserve.model import init_params
from llmserve.sampling_params import SamplingParams
from llmserve.testing.invariance import Target, engine_factory, invariance_matrix


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_differing_bits_under_every_condition(dtype):
    cfg = preset("tiny-9-3").replace(dtype=dtype)
    params = init_params(cfg, seed=3)
    make = engine_factory(cfg, params, max_model_len=96, max_num_seqs=8, page_size=4,
                          max_num_batched_tokens=32, prefill_buckets=((1, 8), (4, 16)),
                          decode_buckets=(8,), max_logprobs=2)
    rng = np.random.default_rng(1)
    targets = [Target(rng.integers(1, cfg.vocab_size, n).tolist(),
                      SamplingParams(temperature=t, seed=s, max_tokens=10, logprobs=1,
                                     ignore_eos=True))
               for n, t, s in ((40, 0.0, 1), (9, 0.0, 2), (23, 0.8, 3), (57, 1.0, 4))]
    matrix = invariance_matrix(make, targets, vocab=cfg.vocab_size, cotenants=(7, 31),
                               max_prompt=48, max_new=10)
    assert matrix.pop("preemptions")[0] > 0
    assert matrix == {k: (0, 0) for k in matrix}, matrix


def test_default_mode_is_not_invariant_in_fp32():
    """The oracle is sharp: without the mode, co-tenants change the logprob bits (on the
    ``xla`` backend: XLA's dots round a row by how many rows the call has. The ``cpu``
    backend's native kernels and the fixed-order RMSNorm already keep this target's rows
    apart from its co-tenants' in the default mode.)"""
    cfg = preset("tiny-9-3")
    params = init_params(cfg, seed=3)
    from llmserve.engine import Engine, EngineConfig
    from llmserve.testing.invariance import differing, random_cotenants, run

    def make():
        eng = Engine(cfg, params, None, EngineConfig(
            max_model_len=96, max_num_seqs=8, page_size=4, max_num_batched_tokens=32,
            prefill_buckets=((1, 8), (4, 16)), decode_buckets=(1, 8), max_logprobs=2,
            enable_prefix_caching=False, backend="xla"))
        eng.warmup()
        return eng

    target = ("t", list(range(5, 45)), SamplingParams(temperature=0, max_tokens=10, logprobs=1,
                                                      ignore_eos=True))
    alone = run(make(), [target])["t"]
    others = random_cotenants(np.random.default_rng(0), cfg.vocab_size, 7, 40, 10, "c")
    crowd = run(make(), [target] + others)["t"]
    assert differing(alone, crowd)[1] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_mode_on_cpu_leaves_a_prompts_bits_to_its_chunking(dtype):
    """The ``cpu`` backend's default mode: a prompt prefilled in one 96-token chunk, in 16-token
    rows, or in 8-token blocks gives bitwise the same tokens and logprobs (SmolLM2's widths, 2
    layers). Every paged attention call runs the native kernel, whose rows never depend on the
    rows beside them; until 2026-12-08 chunk rows of more than 10 tokens took XLA's batched
    path and rounded apart from shorter ones."""
    from llmserve.engine import Engine, EngineConfig
    from llmserve.ops import cpu_kernels
    from llmserve.ops.attention import default_backend

    from .test_engine import run_all

    if default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the native CPU kernels are not the default backend here")
    cfg = preset("smollm2-135m").replace(vocab_size=512, n_layers=2, dtype=dtype)
    params = init_params(cfg, seed=2)
    prompt = np.random.default_rng(4).integers(1, cfg.vocab_size, 90).tolist()
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)

    def serve(buckets):
        eng = Engine(cfg, params, None, EngineConfig(
            max_model_len=128, max_num_seqs=2, page_size=16, max_num_batched_tokens=96,
            prefill_buckets=buckets, decode_buckets=(2,), max_logprobs=2))
        out = run_all(eng, [prompt], [sp])[0].outputs[0]
        return out.token_ids, out.logprobs

    want = serve(((1, 96),))
    assert serve(((6, 16),)) == want
    assert serve(((12, 8),)) == want
