r"""Where one engine decode step's time goes, per attention backend (issue 9's breakdown).

  python -m experiments.step_profile --config=configs/step_profile.py          # ~3 min
  python -m experiments.step_profile --config=configs/step_profile.py:smoke    # ~30 s, tiny
  python -m experiments.step_profile --config=configs/step_profile.py --config.dtype=float32
  python -m experiments.step_profile --config=configs/step_profile.py --config.context=512

``runlocal`` is an alias of ``smoke`` (a random-weight tiny model: checks the pipeline only).
For each backend in ``backends`` (default: the XLA gather path = before, the native CPU kernel =
after) it fills ``batch`` slots of SmolLM2-135M with ``context``-token random prompts, lets every
row reach decode, times ``steps`` decode steps (median wall), then traces ``trace_steps`` more
with jax.profiler and splits the device time by XLA op: weight matmuls, attention, K/V and
embedding gathers/scatters, sampling, and the rest; host time is wall minus device.
"""

import ml_collections


def get_config(arg: str = "full") -> ml_collections.ConfigDict:
    """``arg``: "full" (default) or "smoke" (alias "runlocal")."""
    arg = {"runlocal": "smoke"}.get(arg, arg)
    if arg not in ("full", "smoke"):
        raise ValueError(f"step_profile config arg {arg!r}: use full or smoke")
    smoke = arg == "smoke"
    c = ml_collections.ConfigDict()
    c.name = arg
    c.out_root = ""  # "" = results/ (or $LLMSERVE_RESULTS)
    c.model = "tiny-9-3" if smoke else ""  # "" = SmolLM2-135M-Instruct; else a random preset
    c.dtype = "bfloat16"
    c.backends = "cpu" if smoke else "xla,cpu"  # smoke: the pipeline once (CI time)
    c.batch = 4 if smoke else 32
    c.context = 24 if smoke else 200
    c.steps = 3 if smoke else 8
    c.trace_steps = 2 if smoke else 5
    # "" = the engine's default prefill buckets; smoke: two ("rows x tokens"), so warm-up compiles
    # 6 step shapes instead of 18 (CI time).
    c.prefill_buckets = "4x8,16x8" if smoke else ""
    return c
