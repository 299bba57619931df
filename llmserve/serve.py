r"""Runs the OpenAI-compatible server (``llmserve serve`` is the same command).

    python -m llmserve.serve                                   # SmolLM2-135M-Instruct on :8000
    python -m llmserve.serve --model=/path/to/hf_dir --host=127.0.0.1 --port=8000
    python -m llmserve.serve --api-key=secret --max-num-seqs=64 --max-model-len=4096
    python -m llmserve.serve --flagfile=serve.flags            # flags from a file

Flags may be spelled with dashes (vLLM's ``--served-model-name``) or underscores.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from absl import flags, logging

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the server's flags (once per process; ``llmserve serve`` calls it)."""
    flags.DEFINE_string("model", None, "HF directory or .gguf file (default: SmolLM2-135M).")
    flags.DEFINE_string("served_model_name", None, "Name clients send (default: the model's).")
    flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
    flags.DEFINE_integer("port", 8000, "Port to bind.")
    flags.DEFINE_string("api_key", None, "If set, /v1 routes need 'Authorization: Bearer <key>'.")
    flags.DEFINE_string("dtype", "float32", "Parameter and KV cache dtype.")
    flags.DEFINE_string("backend", None, "Attention backend: xla | pallas | reference.")
    flags.DEFINE_integer("max_model_len", 2048, "Longest prompt + completion, in tokens.")
    flags.DEFINE_integer("max_num_seqs", 32, "Sequences decoded together (slots).")
    flags.DEFINE_integer("max_num_batched_tokens", 512, "Token budget of one step.")
    flags.DEFINE_bool("prefill_first", False,
                      "Run prefill-only steps while a burst of waiting requests fits the free "
                      "slots (offline throughput); off: decode rows always share the step "
                      "(steadier inter-token latency).")
    flags.DEFINE_bool("async_scheduling", True,
                      "Launch each step before the previous step's tokens reach the host and "
                      "process outputs while it runs (off: synchronous steps).")
    flags.DEFINE_integer("page_size", 16, "Tokens per KV page.")
    flags.DEFINE_integer("num_pages", None, "KV pages (default: each slot fits max_model_len).")
    flags.DEFINE_bool("enable_prefix_caching", True, "Reuse KV pages of shared prompt prefixes.")
    flags.DEFINE_integer("max_logprobs", 5, "Most logprobs / top_logprobs a request may ask for.")
    flags.DEFINE_integer("max_waiting", 256, "Waiting requests past which new ones get a 429.")
    flags.DEFINE_bool("warmup_scoring", True, "Compile prompt-logprob buckets at start-up.")
    flags.DEFINE_integer("seed", 0, "Engine seed (requests without a seed).")


def default_model_name(model: Optional[str]) -> str:
    """The name a model is served under: SmolLM2's, or the file / directory name."""
    import os

    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def build_app():
    """Loads the model from the flags, compiles, and returns the app."""
    from llmserve import LLM
    from llmserve.server import create_app

    t0 = time.time()
    llm = LLM(model=FLAGS.model, dtype=FLAGS.dtype, max_model_len=FLAGS.max_model_len,
              max_num_seqs=FLAGS.max_num_seqs, page_size=FLAGS.page_size,
              num_pages=FLAGS.num_pages, backend=FLAGS.backend,
              enable_prefix_caching=FLAGS.enable_prefix_caching,
              max_num_batched_tokens=FLAGS.max_num_batched_tokens, seed=FLAGS.seed,
              max_logprobs=FLAGS.max_logprobs, prefill_first=FLAGS.prefill_first,
              async_scheduling=FLAGS.async_scheduling)
    name = FLAGS.served_model_name or default_model_name(FLAGS.model)
    app_ = create_app(llm, model_name=name, api_key=FLAGS.api_key,
                      max_waiting=FLAGS.max_waiting)
    scorer = app_.state.serving.scorer
    if FLAGS.warmup_scoring and scorer is not None:
        scorer.warmup()
    logging.info("loaded and compiled %s in %.1fs", name, time.time() - t0)
    return app_, name


def main(argv):
    del argv
    import uvicorn

    app_, name = build_app()
    print(f"serving {name} on http://{FLAGS.host}:{FLAGS.port}/v1", flush=True)
    uvicorn.run(app_, host=FLAGS.host, port=FLAGS.port, log_level="info")


def run(argv: Optional[list[str]] = None) -> None:
    """Entry point: parses flags (dashes or underscores) and serves."""
    from llmserve.cli import main as cli_main

    argv = sys.argv if argv is None else argv
    cli_main([argv[0], "serve", *argv[1:]])


if __name__ == "__main__":
    run()
