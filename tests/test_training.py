"""Training: losses, data, the jitted optax step, exact resume, export that LLM() loads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llmserve.config import preset
from llmserve.model import init_params
from llmserve.training import (
    LossConfig,
    OptimConfig,
    TokenDataset,
    acceptance,
    init_train_state,
    losses,
    lr_schedule,
    make_optimizer,
    make_train_step,
    pack_sequences,
    pad_sequences,
    precompute_teacher_topk,
    save_model,
    split_params,
    train,
)

CFG = preset("tiny-mqa")  # vocab 256, tied embeddings
OPT_CFG = OptimConfig(learning_rate=3e-3, warmup_steps=2, total_steps=30)


@pytest.fixture(scope="module")
def ce_step():
    """(optimizer, jitted CE step) shared by the tests below: one compile for all."""
    opt = make_optimizer(OPT_CFG)
    return opt, make_train_step(CFG, opt, LossConfig("ce"), schedule=lr_schedule(OPT_CFG))


def _pattern_rows(n: int, t: int, seed: int = 0) -> dict:
    """Learnable rows: each is an arithmetic progression mod 64 with a random start/stride."""
    rng = np.random.default_rng(seed)
    starts, strides = rng.integers(0, 64, n), rng.integers(1, 4, n)
    seqs = [(s + d * np.arange(t + 1)) % 64 for s, d in zip(starts, strides)]
    return pad_sequences(seqs, t)


def _tree_equal(a, b) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                      for x, y in zip(la, lb))


# ---------------------------------------------------------------------------- losses
@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_distill_loss_is_zero_when_student_equals_teacher(direction):
    logits = 3.0 * jax.random.normal(jax.random.PRNGKey(0), (2, 5, 300))
    mask = jnp.ones((2, 5))

    @jax.jit
    def both(logits):
        ids, logprobs = losses.teacher_topk(logits, 16)
        return (losses.distill_kl(logits, logits, mask, direction),
                losses.distill_kl_topk(logits, ids, logprobs, mask, direction))

    full, top = both(logits)
    assert abs(float(full)) < 1e-6 and abs(float(top)) < 1e-6


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_topk_kl_is_positive_lower_bound_of_full_kl(direction):
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    teacher = 3.0 * jax.random.normal(k1, (2, 4, 200))
    student = 3.0 * jax.random.normal(k2, (2, 4, 200))
    mask = jnp.ones((2, 4))

    @jax.jit
    def run(student, teacher):
        full = losses.distill_kl(student, teacher, mask, direction)
        ids, logprobs = losses.teacher_topk(teacher, 8)
        top, grads = jax.value_and_grad(
            lambda s: losses.distill_kl_topk(s, ids, logprobs, mask, direction))(student)
        return full, top, grads

    full, top, grads = run(student, teacher)
    assert 0.0 < float(top) <= float(full) + 1e-5
    assert np.isfinite(np.asarray(grads)).all()


def test_cross_entropy_respects_mask():
    logits = jax.random.normal(jax.random.PRNGKey(2), (1, 3, 10))
    targets = jnp.array([[1, 2, 3]])
    only_first = losses.cross_entropy(logits, targets, jnp.array([[1.0, 0.0, 0.0]]))
    expected = -jax.nn.log_softmax(logits[0, 0])[1]
    np.testing.assert_allclose(only_first, expected, rtol=1e-6)


# ---------------------------------------------------------------------------- data
def test_pad_and_pack_sequences():
    rows = pad_sequences([[1, 2, 3], [4, 5, 6, 7, 8, 9]], seq_len=4, pad_id=0,
                         loss_masks=[[0, 1, 1], [0, 0, 1, 1, 1, 1]])
    np.testing.assert_array_equal(rows["inputs"], [[1, 2, 3, 0], [4, 5, 6, 7]])
    np.testing.assert_array_equal(rows["targets"], [[2, 3, 0, 0], [5, 6, 7, 8]])
    np.testing.assert_array_equal(rows["loss_mask"], [[1, 1, 0, 0], [0, 1, 1, 1]])
    packed = pack_sequences([[1, 2, 3], [4, 5]], seq_len=3, sep_id=9)
    np.testing.assert_array_equal(packed["inputs"], [[1, 2, 3], [9, 4, 5]])
    np.testing.assert_array_equal(packed["targets"], [[2, 3, 9], [4, 5, 9]])


def test_dataset_batches_are_a_function_of_position():
    ds = TokenDataset({"x": np.arange(10)}, batch_size=3, seed=5)
    again = TokenDataset({"x": np.arange(10)}, batch_size=3, seed=5)
    assert ds.batches_per_epoch == 3
    for i in range(7):
        np.testing.assert_array_equal(ds.batch(i)["x"], again.batch(i)["x"])
    epoch0 = np.concatenate([ds.batch(i)["x"] for i in range(3)])
    assert len(set(epoch0.tolist())) == 9  # no row twice within an epoch


def test_acceptance_stats():
    match = np.array([1, 1, 0, 1, 1, 1, 1, 1, 0], bool)
    np.testing.assert_array_equal(acceptance.accepted_lengths(match, 4),
                                  [2, 1, 0, 4, 4, 3, 2, 1, 0])
    # Steps: accept 2 (+1 -> i=3), accept 4 (+1 -> i=8), accept 0 (+1 -> end).
    assert acceptance.simulated_steps(match, 4) == [2, 4, 0]
    stats = acceptance.acceptance_stats([match], k=4)
    assert stats["token_match_rate"] == pytest.approx(7 / 9)
    assert stats["tokens_per_step"] == pytest.approx(1 + 2)


# ---------------------------------------------------------------------------- the step
def test_lr_schedule_warms_up_then_decays():
    sched = lr_schedule(OptimConfig(learning_rate=1.0, warmup_steps=10, total_steps=100,
                                    end_lr_fraction=0.1))
    assert float(sched(0)) == 0.0 and float(sched(10)) == pytest.approx(1.0)
    assert float(sched(100)) == pytest.approx(0.1)


def test_a_few_steps_reduce_the_cross_entropy(ce_step):
    opt, step = ce_step
    state = init_train_state(init_params(CFG, seed=0), opt)
    ds = TokenDataset(_pattern_rows(32, 16), batch_size=8)
    state, history = train(step, state, ds, num_steps=30, log_every=1, progress=False)
    assert int(state.step) == 30
    first, last = history[0]["loss"], np.mean([h["loss"] for h in history[-3:]])
    assert last < first - 1.0, (first, last)
    assert {"loss", "ce", "accuracy", "grad_norm", "lr", "tokens_per_s"} <= set(history[-1])


@pytest.mark.parametrize("teacher", ["online", "precomputed"])
def test_distillation_with_a_frozen_shared_embedding(teacher):
    teacher_params = init_params(CFG, seed=1)
    student_cfg = CFG.replace(n_layers=1)
    full = init_params(student_cfg, seed=2)
    full["embed"] = teacher_params["embed"]  # share the target's tied embedding / LM head
    trainable, frozen = split_params(full, ["embed"])
    rows = _pattern_rows(16, 12)
    if teacher == "precomputed":
        rows.update(precompute_teacher_topk(CFG, teacher_params, rows["inputs"], k=32,
                                            batch_size=8))
    opt = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1, total_steps=15))
    step = make_train_step(student_cfg, opt, LossConfig("distill", teacher=teacher),
                           teacher_cfg=CFG)
    state = init_train_state(trainable, opt)
    assert "embed" not in state.params
    state, history = train(step, state, TokenDataset(rows, batch_size=8), num_steps=15,
                           frozen=frozen, teacher_params=teacher_params, log_every=1,
                           progress=False)
    assert history[-1]["kl"] < 0.5 * history[0]["kl"], (history[0]["kl"], history[-1]["kl"])
    assert _tree_equal(frozen["embed"], teacher_params["embed"])


def test_resume_after_interrupt_is_bit_exact(tmp_path, ce_step):
    opt, step = ce_step
    # Same shapes as the CE test (no recompile); 5 batches/epoch, so the data wraps.
    ds = TokenDataset(_pattern_rows(40, 16, seed=1), batch_size=8, seed=3)
    params = init_params(CFG, seed=0)

    straight, _ = train(step, init_train_state(params, opt), ds, num_steps=8,
                        ckpt_dir=str(tmp_path / "a"), ckpt_every=4, progress=False)
    # "Killed" after 4 steps (its checkpoint at step 4 is on disk), then restarted.
    half, _ = train(step, init_train_state(params, opt), ds, num_steps=8,
                    ckpt_dir=str(tmp_path / "b"), ckpt_every=4, stop_after=4,
                    progress=False)
    assert int(half.step) == 4
    log = tmp_path / "log.jsonl"
    resumed, history = train(step, init_train_state(params, opt), ds, num_steps=8,
                             ckpt_dir=str(tmp_path / "b"), ckpt_every=4, log_path=str(log),
                             log_every=1, progress=False)
    assert [h["step"] for h in history] == [5, 6, 7, 8]
    assert len(log.read_text().splitlines()) == 4
    assert int(resumed.step) == 8
    assert _tree_equal(straight.params, resumed.params)
    assert _tree_equal(straight.opt_state, resumed.opt_state)


# ---------------------------------------------------------------------------- export
def test_saved_model_loads_back_and_generates(tmp_path):
    from llmserve.checkpoint import load_checkpoint, restore_params
    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams
    from llmserve.training.bpe import train_bpe_tokenizer

    corpus = ["def add(a, b):\n    return a + b\n", "def sub(a, b):\n    return a - b\n",
              "print('hello world')\n", "for i in range(10):\n    print(i)\n"] * 4
    tok = train_bpe_tokenizer(corpus, vocab_size=300)
    cfg = CFG.replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id, max_position_embeddings=128)
    params = init_params(cfg, seed=0)
    paths = save_model(str(tmp_path / "model"), cfg, params, tokenizer=tok)

    cfg2, loaded = load_checkpoint(paths["hf_dir"])
    assert cfg2.vocab_size == cfg.vocab_size and cfg2.tie_embeddings
    assert _tree_equal(params, loaded)
    assert _tree_equal(params, restore_params(paths["orbax_dir"]))

    llm = LLM(model=paths["hf_dir"], max_num_seqs=2, max_model_len=64, warmup=False)
    outs = llm.generate(["def add(a, b):", "print("],
                        SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
    assert tok.decode(tok.encode(corpus[0])) == corpus[0]
