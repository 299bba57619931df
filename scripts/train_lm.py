r"""Train a small Llama-style language model from scratch on local text.

  python scripts/train_lm.py --config=configs/train_lm.py:cpu

1. corpus: the Python standard library's source (or a text file / directory of files);
2. tokenizer: byte-level BPE trained with the `tokenizers` library, saved as tokenizer.json;
3. data: the token stream packed into [B, T] rows (the last rows held out);
4. train: next-token cross-entropy, AdamW (warmup + cosine, clipping), Orbax checkpoints
   every N steps (restarting resumes exactly), tqdm + JSON-lines metrics;
5. export: a Hugging Face directory (config.json, model.safetensors, tokenizer.json) that
   LLM(model=...) loads, plus Orbax params; a greedy sample is generated through LLM.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, logging
from ml_collections import config_flags

from llmserve.config import ModelConfig
from llmserve.model import init_params
from llmserve.training import (
    LossConfig,
    OptimConfig,
    TokenDataset,
    forward_logits,
    init_train_state,
    losses,
    lr_schedule,
    make_optimizer,
    make_train_step,
    pack_sequences,
    save_model,
    train,
)
from llmserve.training import prompts as prompt_lib
from llmserve.training.bpe import train_bpe_tokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import common  # noqa: E402  (the repository root, for `python scripts/...`)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/train_lm.py:cpu",
                                          "training config", lock_config=True)


def read_corpus(source: str, max_modules) -> list[str]:
    """Documents: stdlib sources, the files of a directory, or one text file."""
    if source == "stdlib":
        return list(prompt_lib.stdlib_corpus(max_modules))
    if os.path.isdir(source):
        docs = []
        for root, _, files in sorted(os.walk(source)):
            for name in sorted(files):
                if name.endswith((".py", ".txt", ".md")):
                    with open(os.path.join(root, name), encoding="utf-8", errors="ignore") as f:
                        docs.append(f.read())
        return docs
    with open(source, encoding="utf-8") as f:
        return [f.read()]


def model_config(config, tokenizer) -> ModelConfig:
    """The ModelConfig for the configured dims and the trained tokenizer's vocabulary."""
    m = config.model
    return ModelConfig(vocab_size=tokenizer.vocab_size, d_model=m.d_model, n_layers=m.n_layers,
                       n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                       head_dim=m.d_model // m.n_heads, ffn_dim=m.ffn_dim,
                       rope_theta=m.rope_theta, tie_embeddings=m.tie_embeddings,
                       max_position_embeddings=m.max_position_embeddings,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)


def eval_loss(cfg: ModelConfig, params, rows: dict, batch_size: int, backend: str) -> float:
    """Mean cross-entropy over held-out rows (whole batches only)."""
    @jax.jit
    def ce(p, inputs, targets, mask):
        return losses.cross_entropy(forward_logits(cfg, p, inputs, backend), targets, mask)

    n = len(rows["inputs"]) // batch_size * batch_size
    vals = [float(ce(params, *(jnp.asarray(rows[k][i:i + batch_size])
                               for k in ("inputs", "targets", "loss_mask"))))
            for i in range(0, n, batch_size)]
    return float(np.mean(vals)) if vals else float("nan")


def main(argv):
    del argv
    import logging as py_logging

    # Orbax logs every save at INFO; keep our lines and its warnings.
    py_logging.getLogger("absl").addFilter(
        lambda r: "orbax" not in r.pathname or r.levelno >= py_logging.WARNING)
    config = _CONFIG.value
    t_start = time.perf_counter()
    workdir = os.path.abspath(config.workdir)
    os.makedirs(workdir, exist_ok=True)

    docs = read_corpus(config.corpus.source, config.corpus.max_modules)
    tok_path = os.path.join(workdir, "tokenizer.json")
    if os.path.exists(tok_path):  # a restarted run must keep the same ids
        from llmserve.tokenizer import Tokenizer
        from llmserve.training.bpe import CHATML_TEMPLATE, DEFAULT_SPECIAL_TOKENS

        eos = DEFAULT_SPECIAL_TOKENS[0]
        tokenizer = Tokenizer.from_file(tok_path, bos_token=eos, eos_token=eos,
                                        chat_template=CHATML_TEMPLATE)
    else:
        tokenizer = train_bpe_tokenizer(docs, config.tokenizer.vocab_size)
        with open(tok_path, "w") as f:
            f.write(tokenizer.to_tokenizer_json())
    ids = tokenizer.encode_batch(docs)
    rows = pack_sequences(ids, config.train.seq_len, sep_id=tokenizer.eos_token_id)
    n_eval = max(config.train.batch_size, int(len(rows["inputs"]) * config.corpus.eval_fraction))
    train_rows = {k: v[:-n_eval] for k, v in rows.items()}
    eval_rows = {k: v[-n_eval:] for k, v in rows.items()}
    logging.info("corpus: %d docs, %d tokens, %d train rows, %d eval rows", len(docs),
                 sum(len(i) for i in ids), len(train_rows["inputs"]), n_eval)

    cfg = model_config(config, tokenizer)
    tc = config.train
    opt_cfg = OptimConfig(learning_rate=tc.learning_rate, warmup_steps=tc.warmup_steps,
                          total_steps=tc.steps, end_lr_fraction=tc.end_lr_fraction,
                          weight_decay=tc.weight_decay, clip_norm=tc.clip_norm)
    optimizer = make_optimizer(opt_cfg)
    step = make_train_step(cfg, optimizer, LossConfig("ce"), schedule=lr_schedule(opt_cfg),
                           backend=tc.backend)
    params = init_params(cfg, seed=config.seed)
    logging.info("model: %.2fM params", cfg.num_params() / 1e6)
    loss_before = eval_loss(cfg, params, eval_rows, tc.batch_size, tc.backend)
    t = time.perf_counter()
    state, history = train(step, init_train_state(params, optimizer),
                           TokenDataset(train_rows, tc.batch_size, seed=config.seed),
                           num_steps=tc.steps, ckpt_dir=os.path.join(workdir, "train_ckpt"),
                           ckpt_every=tc.ckpt_every,
                           log_path=os.path.join(workdir, "train_log.jsonl"),
                           log_every=tc.log_every, desc="train_lm")
    train_s = time.perf_counter() - t
    params = jax.device_get(state.params)
    loss_after = eval_loss(cfg, params, eval_rows, tc.batch_size, tc.backend)
    paths = save_model(os.path.join(workdir, "model"), cfg, params, tokenizer)

    from llmserve.llm import LLM
    from llmserve.sampling_params import SamplingParams

    llm = LLM(model=paths["hf_dir"], max_num_seqs=2, max_model_len=256, warmup=False)
    sample = llm.generate([config.sample_prompt], SamplingParams(
        temperature=0.0, max_tokens=config.sample_tokens), use_tqdm=False)[0].outputs[0].text
    logging.info("eval loss %.3f -> %.3f; sample:\n%s%s", loss_before, loss_after,
                 config.sample_prompt, sample)
    summary = {"config": config.to_dict(), "model_config": cfg.to_hf_dict(),
               "params_m": cfg.num_params() / 1e6, "eval_loss_init": loss_before,
               "eval_loss": loss_after,
               "train": {"first": history[0] if history else None,
                         "last": history[-1] if history else None},
               "sample": config.sample_prompt + sample, "train_s": train_s,
               "total_s": time.perf_counter() - t_start, "paths": paths}
    out = common.run_dir("train_lm", config.results_root or None)
    png = common.loss_curve(out, history, f"train_lm {config.name}: {cfg.num_params() / 1e6:.2f}M "
                            f"params, eval loss {loss_before:.2f} -> {loss_after:.2f}")
    path = common.write_results(out, "train_lm", config, summary,
                                {"eval_loss_init": loss_before, "eval_loss": loss_after,
                                 "train_s": train_s}, [], [png], history=history)
    logging.info("wrote %s and %s", path, png)


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
