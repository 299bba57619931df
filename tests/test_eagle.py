"""EAGLE draft head: engine-time (paged) == training-time (dense) forward, the drafting chain,
padding, compilation, training + resume, files, bad config values. Tiny presets, fast."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmserve import sampling
from llmserve.config import preset
from llmserve.model import init_params
from llmserve.sampling import SamplingArrays
from llmserve.speculative import eagle
from llmserve.training import OptimConfig, TokenDataset, init_train_state, make_optimizer, train
from llmserve.training import eagle as eagle_train

CFG = preset("tiny-9-3")  # V=320, D=72, 9 heads over 3 kv heads
VD = 100
PAGE = 4
# f32 everywhere: the paged (xla) and dense (reference) paths differ only by summation order.
ATOL = 2e-5
_FWD = jax.jit(eagle.eagle_forward, static_argnames=("ecfg", "backend"))
_DENSE = jax.jit(eagle.eagle_forward_dense, static_argnames=("ecfg", "backend"))


@jax.jit
def _q_oracle(logits, vocab_map, arrays, counts, prompt_mask):
    """q over the target's vocabulary: probs_from_logits of the scattered draft logits."""
    full = eagle.scatter_logits(logits, vocab_map, CFG.vocab_size)
    return sampling.probs_from_logits(full, arrays, counts, prompt_mask)


def _setup(seed=0):
    target = init_params(CFG, seed=seed)
    ecfg = eagle.EagleConfig.from_target(CFG, VD)
    head = eagle.init_head_params(ecfg, seed=seed + 1)
    # Larger head weights than init so the logits are of order 1-10 (argmax not a near tie).
    head = jax.tree_util.tree_map(lambda x: x * 4.0 if x.ndim == 2 else x, head)
    rng = np.random.default_rng(seed)
    vocab_map = np.sort(rng.choice(CFG.vocab_size, VD, replace=False)).astype(np.int32)
    return ecfg, head, target["embed"], target["final_norm"], jnp.asarray(vocab_map)


def _inputs(b, t, seed=0):
    rng = np.random.default_rng(seed + 10)
    feats = rng.normal(size=(b, t, CFG.d_model)).astype(np.float32) * 3.0
    feats[:, 0] = 0.0  # h_{-1} = 0: the input of position 0
    toks = rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
    return feats, toks


def _tables(b, pages_per_row):
    return 1 + np.arange(b * pages_per_row, dtype=np.int32).reshape(b, pages_per_row)


def test_paged_engine_forward_equals_dense_training_forward():
    ecfg, head, embed, norm, vm = _setup()
    b, t = 3, 13
    feats, toks = _inputs(b, t)
    f_dense, lg_dense = _DENSE(head, embed, norm, vm, jnp.asarray(feats),
                                                  jnp.asarray(toks), ecfg=ecfg)
    tables = jnp.asarray(_tables(b, 4))
    cache = eagle.create_cache(ecfg, 1 + b * 4, PAGE)
    fwd = _FWD
    # Rows prefill different amounts (row 2 is a padding row in the first chunk), then stream
    # one input per call, as the engine does.
    first = np.array([6, 2, 0], np.int32)
    chunk = 6
    fc = np.zeros((b, chunk, CFG.d_model), np.float32)
    tc = np.zeros((b, chunk), np.int32)
    for i in range(b):
        fc[i, :first[i]] = feats[i, :first[i]]
        tc[i, :first[i]] = toks[i, :first[i]]
    f0, lg0, cache = fwd(head, embed, norm, vm, cache, jnp.asarray(fc), jnp.asarray(tc),
                         jnp.zeros(b, jnp.int32), jnp.asarray(first), tables, ecfg=ecfg)
    got_f = [[np.asarray(f0[i, j]) for j in range(first[i])] for i in range(b)]
    got_l = [[np.asarray(lg0[i, j]) for j in range(first[i])] for i in range(b)]
    pos = first.copy()
    while np.any(pos < t):
        live = pos < t
        c = np.minimum(pos, t - 1)
        f1, lg1, cache = fwd(head, embed, norm, vm, cache,
                             jnp.asarray(feats[np.arange(b), c][:, None]),
                             jnp.asarray(toks[np.arange(b), c][:, None]),
                             jnp.asarray(np.where(live, pos, 0)),
                             jnp.asarray(live.astype(np.int32)), tables, ecfg=ecfg)
        for i in np.nonzero(live)[0]:
            got_f[i].append(np.asarray(f1[i, 0]))
            got_l[i].append(np.asarray(lg1[i, 0]))
        pos = np.where(live, pos + 1, pos)
    np.testing.assert_allclose(np.stack([np.stack(r) for r in got_f]), f_dense, atol=ATOL,
                               rtol=1e-5)
    np.testing.assert_allclose(np.stack([np.stack(r) for r in got_l]), lg_dense, atol=ATOL,
                               rtol=1e-5)


def _step_by_step(ecfg, head, embed, norm, vm, feats, toks, q_start, n_valid, tables, r):
    """The chain by hand with eagle_forward: tail, then (f, draft) one position at a time."""
    cache = eagle.create_cache(ecfg, 1 + tables.size, PAGE)
    b = feats.shape[0]
    f, lg, cache = _FWD(head, embed, norm, vm, cache, feats, toks, q_start,
                                       n_valid, tables, ecfg=ecfg)
    last = np.maximum(np.asarray(n_valid) - 1, 0)
    f_prev = np.asarray(f)[np.arange(b), last]
    logits = [np.asarray(lg)[np.arange(b), last]]
    tok = np.asarray(vm)[np.argmax(logits[-1], -1)]
    tokens = [tok]
    pos0 = np.asarray(q_start) + np.asarray(n_valid)
    for j in range(1, r):
        f, lg, cache = _FWD(head, embed, norm, vm, cache,
                                           jnp.asarray(f_prev[:, None]),
                                           jnp.asarray(tok[:, None].astype(np.int32)),
                                           jnp.asarray(pos0 + j - 1),
                                           jnp.asarray((np.asarray(n_valid) > 0).astype(
                                               np.int32)), tables, ecfg=ecfg)
        f_prev = np.asarray(f)[:, 0]
        logits.append(np.asarray(lg)[:, 0])
        tok = np.asarray(vm)[np.argmax(logits[-1], -1)]
        tokens.append(tok)
    return np.stack(tokens, 1), np.stack(logits, 1)


def _no_history(b):
    """Zero output counts and an empty prompt mask: every propose call in this file passes
    them, so the calls of one shape share one compilation."""
    return (jnp.zeros((b, CFG.vocab_size), jnp.int32),
            jnp.zeros((b, CFG.vocab_size), jnp.bool_))


def test_propose_chain_equals_step_by_step_and_greedy_is_mapped_argmax():
    ecfg, head, embed, norm, vm = _setup(seed=1)
    b, t, r = 2, 5, 4
    feats, toks = _inputs(b, t, seed=1)
    tables = jnp.asarray(_tables(b, 4))
    q_start, n_valid = jnp.zeros(b, jnp.int32), jnp.asarray([5, 3], jnp.int32)
    want_tokens, want_logits = _step_by_step(ecfg, head, embed, norm, vm, jnp.asarray(feats),
                                             jnp.asarray(toks), q_start, n_valid, tables, r)
    cache = eagle.create_cache(ecfg, 1 + b * 4, PAGE)
    out, _ = eagle.eagle_propose(head, embed, norm, vm, cache, jnp.asarray(feats),
                                 jnp.asarray(toks), q_start, n_valid, tables,
                                 SamplingArrays.neutral(b), *_no_history(b), ecfg=ecfg,
                                 num_draft=r)
    # Greedy drafts: vocab_map[argmax of the step-by-step draft logits], in target ids.
    np.testing.assert_array_equal(np.asarray(out.tokens), want_tokens)
    assert np.all(np.isin(np.asarray(out.tokens), np.asarray(vm)))
    probs = np.asarray(out.probs)
    assert probs.shape == (b, r, CFG.vocab_size)
    np.testing.assert_array_equal(probs.argmax(-1), want_tokens)  # one-hot q for greedy rows

    # A sampled row with penalties and a greedy row with a repetition penalty: q =
    # probs_from_logits of the step-by-step logits scattered into V, with the counts of the
    # earlier drafts (the chain conditions on its own tokens: the oracle is fed the drafts).
    rows = [dict(temperature=0.9, top_k=30, seed=3, frequency_penalty=0.5,
                 repetition_penalty=1.3), dict(repetition_penalty=2.0)]
    arrays = SamplingArrays.from_lists(rows)
    rng = np.random.default_rng(5)
    counts = np.zeros((b, CFG.vocab_size), np.int32)
    counts[:, np.asarray(vm)[::3]] = rng.integers(0, 3, (b, len(vm[::3])))
    pmask = np.zeros((b, CFG.vocab_size), bool)
    pmask[:, np.asarray(vm)[1::4]] = True
    cache = eagle.create_cache(ecfg, 1 + b * 4, PAGE)
    out, _ = eagle.eagle_propose(head, embed, norm, vm, cache, jnp.asarray(feats),
                                 jnp.asarray(toks), q_start, n_valid, tables, arrays,
                                 jnp.asarray(counts), jnp.asarray(pmask), ecfg=ecfg,
                                 num_draft=r)
    drafts = np.asarray(out.tokens)
    cache = eagle.create_cache(ecfg, 1 + b * 4, PAGE)
    f, lg, cache = _FWD(head, embed, norm, vm, cache, jnp.asarray(feats),
                                       jnp.asarray(toks), q_start, n_valid, tables, ecfg=ecfg)
    last = np.asarray(n_valid) - 1
    f_prev, lgj = np.asarray(f)[np.arange(b), last], np.asarray(lg)[np.arange(b), last]
    for j in range(r):
        q = _q_oracle(jnp.asarray(lgj), vm, arrays, jnp.asarray(counts), jnp.asarray(pmask))
        np.testing.assert_allclose(np.asarray(out.probs)[:, j], q, atol=1e-5)
        assert np.all(np.asarray(q)[np.arange(b), drafts[:, j]] > 0)
        assert drafts[1, j] == np.argmax(q[1])  # the greedy row: the penalized argmax
        counts[np.arange(b), drafts[:, j]] += 1
        f, lg, cache = _FWD(head, embed, norm, vm, cache,
                                           jnp.asarray(f_prev[:, None]),
                                           jnp.asarray(drafts[:, j:j + 1]),
                                           jnp.asarray(np.asarray(n_valid) + j),
                                           jnp.ones(b, jnp.int32), tables, ecfg=ecfg)
        f_prev, lgj = np.asarray(f)[:, 0], np.asarray(lg)[:, 0]


def test_padding_rows_write_only_page_zero_and_compile_once():
    ecfg, head, embed, norm, vm = _setup(seed=2)
    b, t, r = 2, 5, 4
    feats, toks = _inputs(b, t, seed=2)
    tables = jnp.asarray(_tables(b, 4))
    cache = eagle.create_cache(ecfg, 1 + b * 4, PAGE)

    def sentinel():
        return jnp.full(cache.k[0].shape, 7.0, cache.k[0].dtype)

    def filled():  # positions 0..3 hold 7.0 too: the rows attend to them
        return cache.replace(k=(sentinel(),), v=(sentinel(),))

    cache = filled()

    def propose(cache, n_valid, with_probs=True):
        return eagle.eagle_propose(head, embed, norm, vm, cache, jnp.asarray(feats),
                                   jnp.asarray(toks), jnp.asarray([4, 4], jnp.int32),
                                   jnp.asarray(n_valid, jnp.int32), tables,
                                   SamplingArrays.neutral(b), *_no_history(b), ecfg=ecfg,
                                   num_draft=r, with_probs=with_probs)

    out, cache = propose(cache, [5, 0])  # row 1 is padding
    k = np.asarray(cache.k[0])  # [K, P, L, H]
    row1_pages = np.asarray(tables)[1]
    assert np.all(k[:, row1_pages] == 7.0)  # the padding row's pages are untouched
    assert np.any(k[:, 0] != 7.0)  # its writes went to the dummy page
    assert np.any(k[:, np.asarray(tables)[0]] != 7.0)
    n_compiled = eagle.eagle_propose._cache_size()
    out2, cache = propose(cache, [1, 2])
    assert eagle.eagle_propose._cache_size() == n_compiled  # the second call reused it
    # Skipping probs changes nothing else.
    no_q, _ = propose(filled(), [5, 0], with_probs=False)
    assert no_q.probs is None
    np.testing.assert_array_equal(no_q.tokens[0], out.tokens[0])


def _smoke_rows(config, ecfg, target):
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(0, CFG.vocab_size, rng.integers(8, 17))) for _ in range(8)]
    feats = eagle_train.target_features(CFG, target, seqs, 16, batch_size=4)
    vm = eagle.frequent_vocab(seqs, CFG.vocab_size, VD)
    rows = eagle_train.eagle_rows(feats, vm, CFG.vocab_size)
    return {k: rows[k] for k in ("inputs", "features", "mask", "top1_draft")}, vm


def _load_smoke_config():
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "eagle.py")
    spec = importlib.util.spec_from_file_location("eagle_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_training_lowers_loss_and_resumes_from_orbax(tmp_path):
    config = _load_smoke_config().get_config("smoke")
    tc = config.train
    target = init_params(CFG, seed=0)
    ecfg = eagle.EagleConfig.from_target(CFG, VD)
    rows, vm = _smoke_rows(config, ecfg, target)
    opt_cfg = OptimConfig(learning_rate=tc.learning_rate, warmup_steps=tc.warmup_steps,
                          total_steps=tc.steps, clip_norm=tc.clip_norm)
    optimizer = make_optimizer(opt_cfg)
    step = eagle_train.make_eagle_train_step(
        ecfg, optimizer, eagle_train.EagleLossConfig(ce_weight=tc.ce_weight, noise=tc.noise,
                                                     self_feed=tc.self_feed))
    frozen = {"embed": target["embed"]["embedding"], "norm": target["final_norm"]["scale"],
              "vocab_map": jnp.asarray(vm)}
    head0 = eagle.init_head_params(ecfg, seed=0)
    dataset = TokenDataset(rows, tc.batch_size, seed=0)

    def run(ckpt, stop_after=None):
        return train(step, init_train_state(head0, optimizer), dataset, num_steps=tc.steps,
                     frozen=frozen, ckpt_dir=ckpt and str(ckpt), ckpt_every=tc.ckpt_every,
                     stop_after=stop_after, progress=False, log_every=1)

    full, hist = run(None)
    losses = [h["loss"] for h in hist]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    run(tmp_path / "b", stop_after=tc.ckpt_every)  # interrupted after a checkpoint
    resumed, hist_b = run(tmp_path / "b")
    assert hist_b[0]["step"] == tc.ckpt_every + 1
    for a, b in zip(jax.tree_util.tree_leaves(full.params),
                    jax.tree_util.tree_leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # The trained head round-trips through save_eagle / load_eagle.
    path = eagle.save_eagle(str(tmp_path / "head"), ecfg, full.params, vm)
    ecfg2, params2, vm2 = eagle.load_eagle(path)
    assert ecfg2 == ecfg
    np.testing.assert_array_equal(vm2, vm)
    for a, b in zip(jax.tree_util.tree_leaves(full.params), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ecfg3, params3, _ = eagle.load_eagle(path, dtype="bfloat16")
    assert ecfg3.dtype == "bfloat16"
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params3))


@pytest.mark.parametrize("field,value", [("draft_vocab_size", 0), ("d_model", -1),
                                         ("draft_vocab_size", 10_000), ("n_kv_heads", 4),
                                         ("norm_eps", 0.0), ("dtype", "int3")])
def test_bad_eagle_config_raises_naming_the_field(field, value):
    good = eagle.EagleConfig.from_target(CFG, VD)
    with pytest.raises(ValueError, match=field):
        good.replace(**{field: value})


def test_bad_loss_config_vocab_map_and_config_arg_raise():
    with pytest.raises(ValueError, match="ce_weight"):
        eagle_train.EagleLossConfig(ce_weight=-1.0)
    with pytest.raises(ValueError, match="noise"):
        eagle_train.EagleLossConfig(noise=-0.1)
    ecfg = eagle.EagleConfig.from_target(CFG, 4)
    with pytest.raises(ValueError, match="vocab_map"):
        eagle.check_vocab_map(np.array([1, 1, 2, 3]), ecfg)
    with pytest.raises(ValueError, match="vocab_map"):
        eagle.check_vocab_map(np.array([1, 2, 3]), ecfg)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        eagle.frequent_vocab([[1, 2]], 10, 11)
    with pytest.raises(ValueError, match="smoke"):
        _load_smoke_config().get_config("huge")
    with pytest.raises(ValueError, match="eagle.json"):
        eagle.load_eagle("/nonexistent/eagle/head")


def test_frequent_vocab_picks_most_frequent_sorted_by_id():
    vm = eagle.frequent_vocab([[5, 5, 9, 9, 9, 2], [7, 5]], 12, 3)
    np.testing.assert_array_equal(vm, [2, 5, 9])  # counts 5:3, 9:3, then 2 and 7 tie at 1
