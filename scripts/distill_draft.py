r"""Distill a draft model for speculative decoding from the target (default: SmolLM2-135M).

  python scripts/distill_draft.py --config=configs/distill_draft.py:cpu

Stages (each cached under the workdir, so a killed run restarts where it stopped):
  1. data: the target samples continuations (LLM.chat / LLM.generate) of chat questions and
     of prompts made from Python stdlib functions; held-out prompts get greedy continuations;
  2. teacher: top-k teacher log-probs over every training row (when teacher="precomputed";
     "online" runs the frozen target inside the jitted step instead);
  3. train: a small draft with the target's vocabulary (optionally sharing its frozen tied
     embedding) minimizes KL(teacher || draft) (or the reverse) with AdamW;
  4. export: Orbax params + a Hugging Face directory that LLM(model=...) loads;
  5. acceptance: K=4 greedy proposals teacher-forced along the target's greedy text, distilled
     vs untrained draft; JSON under results/distill/.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, logging
from ml_collections import config_flags

from llmserve.checkpoint import load_checkpoint
from llmserve.llm import LLM
from llmserve.model import init_params
from llmserve.sampling_params import SamplingParams
from llmserve.training import (
    LossConfig,
    OptimConfig,
    TokenDataset,
    acceptance,
    init_train_state,
    lr_schedule,
    make_optimizer,
    make_train_step,
    merge_params,
    pad_sequences,
    precompute_teacher_topk,
    save_model,
    split_params,
    train,
)
from llmserve.training import prompts as prompt_lib
from llmserve.training.checkpoints import quiet_orbax_logs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import common  # noqa: E402  (the repository root, for `python scripts/...`)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/distill_draft.py:cpu",
                                          "distillation config", lock_config=True)


def build_prompts(config, tokenizer, held_out: bool, count: int) -> list[dict]:
    """``count`` prompts (chat and stdlib code) on one side of the train / held-out split.

    Each: {"kind", "ids"}; chat prompts are rendered with the target's chat template.
    Prompts longer than ``max_prompt_tokens`` are skipped.
    """
    frac = config.data.eval_fraction
    rng = np.random.default_rng([config.seed, int(held_out)])
    chats = [p for p, q in zip(prompt_lib.chat_prompts(), prompt_lib.CHAT_QUESTIONS)
             if prompt_lib.is_held_out(q, frac) == held_out]
    fns = [f for f in prompt_lib.stdlib_functions()
           if prompt_lib.is_held_out(f["module"], frac) == held_out]
    codes = [p for i in rng.permutation(len(fns))[: 2 * count]
             for p in prompt_lib.code_prompts(fns[i])]
    rng.shuffle(codes)
    n_chat = min(len(chats), int(round(count * config.data.chat_fraction)))
    chosen = [chats[i] for i in rng.permutation(len(chats))[:n_chat]]
    out = []
    for p in chosen + codes:
        if len(out) >= count:
            break
        if p["kind"] == "chat":
            text = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True)
        else:
            text = p["text"]
        ids = tokenizer.encode(text)
        if 0 < len(ids) <= config.data.max_prompt_tokens:
            out.append({"kind": p["kind"], "ids": ids})
    return out


def generate(llm: LLM, prompts: list[dict], max_tokens: int, temperature: float, top_p: float,
             seed: int) -> tuple[list[dict], dict]:
    """Continuations of ``prompts`` (token ids) by the target; returns (rows, timing)."""
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                             seed=seed + i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate([p["ids"] for p in prompts], params)
    dt = time.perf_counter() - t0
    rows = [{"kind": p["kind"], "prompt": p["ids"], "completion": list(o.outputs[0].token_ids)}
            for p, o in zip(prompts, outs)]
    n = sum(len(r["completion"]) for r in rows)
    return rows, {"seconds": dt, "tokens": n, "tokens_per_s": n / max(dt, 1e-9)}


def make_data(config, workdir: str) -> dict:
    """Stage 1 (cached in data.json): sampled training rows and greedy held-out rows."""
    path = os.path.join(workdir, "data.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    d = config.data
    llm = LLM(model=config.target, max_num_seqs=d.max_num_seqs,
              max_model_len=d.max_prompt_tokens + max(d.max_new_tokens, d.eval_max_new_tokens))
    train_prompts = build_prompts(config, llm.tokenizer, False, d.num_train_prompts)
    eval_prompts = build_prompts(config, llm.tokenizer, True, d.num_eval_prompts)
    logging.info("generating: %d train prompts, %d held-out prompts", len(train_prompts),
                 len(eval_prompts))
    train_rows, train_t = generate(llm, train_prompts, d.max_new_tokens, d.temperature,
                                   d.top_p, config.seed)
    eval_rows, eval_t = generate(llm, eval_prompts, d.eval_max_new_tokens, 0.0, 1.0, 0)
    data = {"train": train_rows, "eval": eval_rows,
            "timing": {"train_generation": train_t, "eval_generation": eval_t},
            "tokenizer_files": llm.tokenizer.files()}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)
    return data


def training_rows(config, data: dict) -> dict:
    """[N, T] rows: prompt + sampled continuation; loss on the continuation (and prompt)."""
    w = 1.0 if config.train.loss_on_prompt else 0.0
    seqs = [r["prompt"] + r["completion"] for r in data["train"]]
    masks = [[w] * len(r["prompt"]) + [1.0] * len(r["completion"]) for r in data["train"]]
    seq_len = config.data.max_prompt_tokens + config.data.max_new_tokens
    return pad_sequences(seqs, seq_len, pad_id=0, loss_masks=masks)


def teacher_rows(config, workdir: str, target_cfg, target_params, rows: dict) -> dict:
    """Stage 2 (cached in teacher.npz): the teacher's top-k log-probs for every row."""
    path = os.path.join(workdir, "teacher.npz")
    if os.path.exists(path):
        with np.load(path) as z:
            return dict(z)
    topk = precompute_teacher_topk(target_cfg, target_params, rows["inputs"], config.train.topk,
                                   batch_size=config.train.batch_size,
                                   backend=config.train.backend, progress=True)
    np.savez(path + ".tmp.npz", **topk)
    os.replace(path + ".tmp.npz", path)
    return topk


def draft_config(config, target_cfg):
    """The draft's ModelConfig: the target's vocabulary, fewer layers (dims overridable)."""
    d = config.draft
    over = {k: getattr(d, k) for k in ("d_model", "n_heads", "n_kv_heads", "head_dim",
                                       "ffn_dim") if getattr(d, k) is not None}
    cfg = target_cfg.replace(n_layers=d.n_layers, tie_embeddings=True, **over)
    if d.share_embedding and cfg.d_model != target_cfg.d_model:
        raise ValueError(f"draft.share_embedding needs d_model={target_cfg.d_model} "
                         f"(got {cfg.d_model})")
    return cfg


def measure(cfg, params, data: dict, k: int, backend: str) -> dict:
    """Acceptance stats of ``params`` along the target's greedy held-out text."""
    matches = acceptance.greedy_matches(cfg, params, [r["prompt"] for r in data["eval"]],
                                        [r["completion"] for r in data["eval"]],
                                        backend=backend)
    return acceptance.acceptance_stats(matches, k)


def main(argv):
    del argv
    quiet_orbax_logs()
    config = _CONFIG.value
    t_start = time.perf_counter()
    workdir = os.path.abspath(config.workdir)
    os.makedirs(workdir, exist_ok=True)
    times = {}

    data = make_data(config, workdir)
    times["data_s"] = time.perf_counter() - t_start
    target_cfg, target_params = load_checkpoint(config.target)
    rows = training_rows(config, data)
    loss_cfg = LossConfig("distill", direction=config.train.direction,
                          teacher=config.train.teacher, ce_weight=config.train.ce_weight)
    t = time.perf_counter()
    if loss_cfg.teacher == "precomputed":
        rows.update(teacher_rows(config, workdir, target_cfg, target_params, rows))
    times["teacher_s"] = time.perf_counter() - t

    cfg = draft_config(config, target_cfg)
    untrained = init_params(cfg, seed=config.seed)
    if config.draft.share_embedding:
        # The LM head is final_norm then the tied embedding: start both from the target's.
        untrained["embed"] = target_params["embed"]
        untrained["final_norm"] = jax.tree_util.tree_map(np.array, target_params["final_norm"])
    frozen_names = ["embed"] if config.draft.share_embedding and config.draft.freeze_embedding \
        else []
    trainable, frozen = split_params(untrained, frozen_names)
    tc = config.train
    opt_cfg = OptimConfig(learning_rate=tc.learning_rate, warmup_steps=tc.warmup_steps,
                          total_steps=tc.steps, end_lr_fraction=tc.end_lr_fraction,
                          weight_decay=tc.weight_decay, clip_norm=tc.clip_norm)
    optimizer = make_optimizer(opt_cfg)
    step = make_train_step(cfg, optimizer, loss_cfg, teacher_cfg=target_cfg,
                           schedule=lr_schedule(opt_cfg), backend=tc.backend)
    dataset = TokenDataset(rows, tc.batch_size, seed=config.seed)
    logging.info("draft: %d layers, d_model %d, %.1fM params (%.1fM trainable); %d rows x %d",
                 cfg.n_layers, cfg.d_model, cfg.num_params() / 1e6,
                 sum(x.size for x in jax.tree_util.tree_leaves(trainable)) / 1e6,
                 dataset.num_rows, rows["inputs"].shape[1])
    t = time.perf_counter()
    state, history = train(
        step, init_train_state(trainable, optimizer), dataset, num_steps=tc.steps,
        frozen=frozen or None,
        teacher_params=target_params if loss_cfg.teacher == "online" else None,
        ckpt_dir=os.path.join(workdir, "train_ckpt"), ckpt_every=tc.ckpt_every,
        log_path=os.path.join(workdir, "train_log.jsonl"), log_every=tc.log_every,
        desc="distill")
    times["train_s"] = time.perf_counter() - t
    draft_params = merge_params(jax.device_get(state.params), frozen)

    from llmserve.tokenizer import Tokenizer

    tok_files = data["tokenizer_files"]
    tok_config = json.loads(tok_files["tokenizer_config.json"])
    tokenizer = Tokenizer.from_str(tok_files["tokenizer.json"],
                                   bos_token=tok_config.get("bos_token"),
                                   eos_token=tok_config.get("eos_token"),
                                   chat_template=tok_config.get("chat_template"))
    paths = save_model(os.path.join(workdir, "draft_hf"), cfg, draft_params, tokenizer)
    _, reloaded = load_checkpoint(paths["hf_dir"])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(reloaded),
                                                    jax.tree_util.tree_leaves(draft_params)))

    t = time.perf_counter()
    k, backend = config.eval.k, tc.backend
    results = {"distilled": measure(cfg, draft_params, data, k, backend),
               "untrained": measure(cfg, untrained, data, k, backend)}
    if config.eval.target_self_check:
        results["target"] = measure(target_cfg, target_params, data, k, backend)
    times["eval_s"] = time.perf_counter() - t
    times["total_s"] = time.perf_counter() - t_start
    for name, r in results.items():
        logging.info("%-9s match %.3f  mean accepted (K=%d) %.2f  tokens/step %.2f", name,
                     r["token_match_rate"], k, r["mean_accepted_len"], r["tokens_per_step"])

    summary = {
        "config": config.to_dict(), "draft_config": cfg.to_hf_dict(),
        "draft_params_m": cfg.num_params() / 1e6, "acceptance": results,
        "data": {"train_rows": len(data["train"]), "eval_rows": len(data["eval"]),
                 "train_tokens": int(sum(len(r["prompt"]) + len(r["completion"])
                                         for r in data["train"])),
                 "generation": data["timing"]},
        "train": {"first": history[0] if history else None,
                  "last": history[-1] if history else None},
        "times_s": times, "paths": paths,
        "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    out = common.run_dir("distill", config.results_root or None)
    png = common.loss_curve(out, history, f"distill {config.name}: {cfg.n_layers}-layer draft, "
                            f"{cfg.num_params() / 1e6:.1f}M params")
    headline = {f"{name}_token_match_rate": r["token_match_rate"]
                for name, r in results.items()}
    headline.update({f"{name}_mean_accepted_len": r["mean_accepted_len"]
                     for name, r in results.items()})
    path = common.write_results(out, "distill", config, summary, headline, [], [png],
                                history=history)
    logging.info("wrote %s and %s (%.0f s total)", path, png, times["total_s"])


if __name__ == "__main__":
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    app.run(main)
