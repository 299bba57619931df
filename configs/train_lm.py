r"""Train a small Llama-style model from scratch on local text (default: the Python stdlib).

CPU:  python scripts/train_lm.py --config=configs/train_lm.py:cpu
GPU:  python scripts/train_lm.py --config=configs/train_lm.py:gpu
Smoke test: python scripts/train_lm.py --config=configs/train_lm.py:smoke
Overrides: --config.train.steps=500 --config.model.n_layers=6

Trains a byte-level BPE tokenizer (the `tokenizers` library) on the corpus, packs the token
stream into [B, T] rows, trains with next-token cross-entropy (AdamW, warmup + cosine,
clipping, Orbax checkpoints every N steps, resumable), then writes
checkpoints/train_lm/<name>/model/ (config.json, model.safetensors, tokenizer.json: loadable
by LLM(model=...)) and results/train_lm/<timestamp>/ (results.json: losses, a sample; loss.png).
"""

import ml_collections


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
    """arg: "cpu", "gpu" or "smoke" (alias "runlocal")."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("cpu", "gpu", "smoke"):
        raise ValueError(f"train_lm config arg {arg!r}: use cpu, gpu or smoke (alias runlocal)")
    c = ml_collections.ConfigDict()
    c.name = arg
    c.workdir = f"checkpoints/train_lm/{arg}"
    c.results_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    c.seed = 0
    c.corpus = ml_collections.ConfigDict()
    c.corpus.source = "stdlib"  # or a path: a text file or a directory of *.py / *.txt files
    c.corpus.max_modules = {"cpu": 60, "gpu": None, "smoke": 5}[arg]
    c.corpus.eval_fraction = 0.05  # the last rows of the packed stream
    c.tokenizer = ml_collections.ConfigDict()
    c.tokenizer.vocab_size = {"cpu": 4096, "gpu": 16384, "smoke": 512}[arg]

    c.model = ml_collections.ConfigDict()
    c.model.n_layers = {"cpu": 4, "gpu": 12, "smoke": 2}[arg]
    c.model.d_model = {"cpu": 256, "gpu": 768, "smoke": 64}[arg]
    c.model.n_heads = {"cpu": 4, "gpu": 12, "smoke": 4}[arg]
    c.model.n_kv_heads = {"cpu": 2, "gpu": 4, "smoke": 2}[arg]
    c.model.ffn_dim = {"cpu": 768, "gpu": 2048, "smoke": 128}[arg]
    c.model.tie_embeddings = True
    c.model.rope_theta = 10000.0
    c.model.max_position_embeddings = 1024

    c.train = ml_collections.ConfigDict()
    c.train.seq_len = {"cpu": 128, "gpu": 512, "smoke": 32}[arg]
    c.train.batch_size = {"cpu": 16, "gpu": 64, "smoke": 4}[arg]
    c.train.steps = {"cpu": 400, "gpu": 20000, "smoke": 6}[arg]
    c.train.learning_rate = {"cpu": 2e-3, "gpu": 1e-3, "smoke": 2e-3}[arg]
    c.train.warmup_steps = {"cpu": 40, "gpu": 1000, "smoke": 1}[arg]
    c.train.end_lr_fraction = 0.1
    c.train.weight_decay = 0.1
    c.train.clip_norm = 1.0
    c.train.ckpt_every = {"cpu": 100, "gpu": 1000, "smoke": 3}[arg]
    c.train.log_every = {"cpu": 10, "gpu": 100, "smoke": 1}[arg]
    c.train.backend = "reference"
    c.sample_prompt = "def read_file(path):\n"
    c.sample_tokens = 48
    return c
