r"""Distill a small draft model for SmolLM2-135M-Instruct (speculative decoding).

CPU (2 cores, ~15 min; <= 30 min):
  python scripts/distill_draft.py --config=configs/distill_draft.py:cpu
GPU (larger data, more steps, the teacher run online inside the jitted step):
  python scripts/distill_draft.py --config=configs/distill_draft.py:gpu
Smoke test (a minute; checks the pipeline end to end, numbers meaningless):
  python scripts/distill_draft.py --config=configs/distill_draft.py:smoke
Overrides: --config.train.steps=100 --config.draft.n_layers=4 --config.train.direction=reverse

Writes results/distill/<timestamp>/ (results.json, loss.png: acceptance of the distilled vs an
untrained draft, with K=4 greedy proposals teacher-forced along the target's greedy text) and, under
checkpoints/distill_draft/<name>/, the training checkpoints, draft_hf/ (loadable by
LLM(model=...)) and draft_hf_orbax/. "runlocal" is an alias of "smoke".
Expected (cpu): the distilled draft matches the target's greedy token far more often than the
untrained one (which matches ~never); see the results JSON for the numbers of a run.
"""

import ml_collections


def get_config(arg: str = "cpu") -> ml_collections.ConfigDict:
    """arg: "cpu", "gpu" or "smoke" (alias "runlocal")."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("cpu", "gpu", "smoke"):
        raise ValueError(f"distill_draft config arg {arg!r}: use cpu, gpu or smoke "
                         "(alias runlocal)")
    c = ml_collections.ConfigDict()
    c.name = arg
    c.target = ml_collections.config_dict.placeholder(str)  # None: built-in SmolLM2-135M
    c.workdir = f"checkpoints/distill_draft/{arg}"
    c.results_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.num_train_prompts = {"cpu": 160, "gpu": 4096, "smoke": 8}[arg]
    c.data.num_eval_prompts = {"cpu": 24, "gpu": 128, "smoke": 4}[arg]
    c.data.chat_fraction = 0.4  # the rest: stdlib code (completion / explain / write)
    c.data.eval_fraction = 0.15  # chat questions and stdlib modules held out for evaluation
    c.data.max_prompt_tokens = {"cpu": 64, "gpu": 256, "smoke": 96}[arg]
    c.data.max_new_tokens = {"cpu": 48, "gpu": 256, "smoke": 16}[arg]
    c.data.eval_max_new_tokens = {"cpu": 48, "gpu": 128, "smoke": 16}[arg]
    c.data.temperature = 0.8
    c.data.top_p = 0.95
    c.data.max_num_seqs = {"cpu": 48, "gpu": 128, "smoke": 8}[arg]

    c.draft = ml_collections.ConfigDict()
    c.draft.n_layers = {"cpu": 2, "gpu": 4, "smoke": 1}[arg]
    # d_model / heads / ffn default to the target's (needed to share its embedding).
    c.draft.d_model = ml_collections.config_dict.placeholder(int)
    c.draft.n_heads = ml_collections.config_dict.placeholder(int)
    c.draft.n_kv_heads = ml_collections.config_dict.placeholder(int)
    c.draft.head_dim = ml_collections.config_dict.placeholder(int)
    c.draft.ffn_dim = ml_collections.config_dict.placeholder(int)
    c.draft.share_embedding = True  # start from the target's tied embedding / LM head
    c.draft.freeze_embedding = True  # ... and keep it frozen (no grads, no Adam state)

    c.train = ml_collections.ConfigDict()
    c.train.steps = {"cpu": 80, "gpu": 3000, "smoke": 4}[arg]
    c.train.batch_size = {"cpu": 8, "gpu": 32, "smoke": 4}[arg]
    c.train.learning_rate = 2e-3
    c.train.warmup_steps = {"cpu": 8, "gpu": 200, "smoke": 1}[arg]
    c.train.end_lr_fraction = 0.1
    c.train.weight_decay = 0.01
    c.train.clip_norm = 1.0
    c.train.direction = "forward"  # KL(teacher || draft); "reverse" = KL(draft || teacher)
    c.train.teacher = {"cpu": "precomputed", "gpu": "online", "smoke": "precomputed"}[arg]
    c.train.topk = 64  # teacher tokens kept when precomputed
    c.train.ce_weight = 0.0
    c.train.loss_on_prompt = True  # the teacher's distribution on prompt tokens is signal too
    c.train.ckpt_every = {"cpu": 40, "gpu": 500, "smoke": 2}[arg]
    c.train.log_every = {"cpu": 2, "gpu": 50, "smoke": 1}[arg]
    c.train.backend = "reference"  # attention for training (differentiable, plain jnp)

    c.eval = ml_collections.ConfigDict()
    c.eval.k = 4
    c.eval.target_self_check = True  # the target's own match rate on its text (~1.0)
    return c
