r"""The ``llmserve`` command (also ``python -m llmserve``).

    llmserve serve [--model=...] [--port=8000] [--api-key=...]   OpenAI-compatible server
    llmserve generate [--prompt="Hello" ...] [--max_tokens=96]   batch chat generation
    llmserve chat [--system="You are ..."]                       interactive streaming chat
    llmserve bench serving --config=configs/serving.py:smoke     a benchmark (throughput|serving)

Each subcommand takes absl flags (``--flagfile=FILE`` reads them from a file; dashes and
underscores are both accepted); ``bench`` takes the experiment's ``--config`` file and its
overrides. ``llmserve <subcommand> --help`` lists a subcommand's flags.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from absl import app, flags

FLAGS = flags.FLAGS

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning a new language.",
    "Write a Python function that checks whether a number is prime.",
    "Why is the sky blue? Answer in two sentences.",
    "Name three famous physicists and one discovery of each.",
    "Translate 'good morning, my friend' into Spanish and French.",
    "What is 17 times 23?",
]

SUBCOMMANDS = ("serve", "generate", "chat", "bench")
BENCHMARKS = ("throughput", "serving")


def _define_model_flags(max_tokens: int, temperature: float) -> None:
    flags.DEFINE_string("model", None, "HF directory or .gguf file (default: SmolLM2-135M).")
    flags.DEFINE_integer("max_tokens", max_tokens, "New tokens per answer.")
    flags.DEFINE_float("temperature", temperature, "0 = greedy.")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling.")
    flags.DEFINE_integer("seed", 0, "Sampling seed.")
    flags.DEFINE_integer("max_num_seqs", 8, "Slots (concurrent sequences).")
    flags.DEFINE_integer("max_model_len", 1024, "Longest prompt + answer, in tokens.")
    flags.DEFINE_string("backend", None, "Attention backend: xla | pallas | reference.")


def _load_llm():
    from llmserve import LLM

    t0 = time.time()
    llm = LLM(model=FLAGS.model, max_num_seqs=FLAGS.max_num_seqs,
              max_model_len=FLAGS.max_model_len, backend=FLAGS.backend)
    cfg = llm.config
    print(f"loaded and compiled in {time.time() - t0:.1f}s ({cfg.n_layers} layers, "
          f"{cfg.n_heads}/{cfg.n_kv_heads} heads)", flush=True)
    return llm


def _sampling_params():
    from llmserve import SamplingParams

    return SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed,
                          max_tokens=FLAGS.max_tokens)


# ---------------------------------------------------------------------------------- generate
def generate_main(argv) -> None:
    """Answers a batch of chat prompts with continuous batching; prints tokens/s."""
    del argv
    llm = _load_llm()
    questions = FLAGS.prompt or DEFAULT_PROMPTS
    t0 = time.time()
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], _sampling_params())
    dt = time.time() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for q, o in zip(questions, outs):
        print(f"\n>>> {q}\n{o.outputs[0].text.strip()}")
    print(f"\n{len(outs)} requests, {n} generated tokens in {dt:.1f}s: {n / dt:.1f} tokens/s "
          f"(continuous batching, {FLAGS.max_num_seqs} slots)")


# ---------------------------------------------------------------------------------- chat
def stream_reply(engine, request_id: str, prompt: str, params, write) -> str:
    """Runs one request on ``engine``, calling ``write(delta)`` as text arrives; its text."""
    engine.add_request(request_id, prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            new = out.outputs[0].text
            if new.startswith(text) and len(new) > len(text):
                write(new[len(text):])
            text = new
    return text


def chat_main(argv) -> None:
    """Interactive chat in the terminal, streaming each reply. /reset clears, /exit quits."""
    del argv
    llm = _load_llm()
    params = _sampling_params()
    system = [{"role": "system", "content": FLAGS.system}] if FLAGS.system else []
    messages = list(system)
    print("chat: empty line or /exit quits, /reset starts over", flush=True)
    for turn in range(10 ** 9):
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            break
        if not line or line == "/exit":
            break
        if line == "/reset":
            messages = list(system)
            continue
        messages.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        sys.stdout.write("bot> ")
        reply = stream_reply(llm.engine, f"chat-{turn}", prompt, params,
                             lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


# ---------------------------------------------------------------------------------- bench
def bench(argv: list[str]) -> None:
    """``bench <throughput|serving> --config=...``: runs ``experiments/<name>.py``."""
    import importlib
    import os

    if not argv or argv[0] not in BENCHMARKS:
        raise SystemExit(f"usage: llmserve bench {{{'|'.join(BENCHMARKS)}}} --config=FILE[:ARG]")
    name = argv[0]
    sys.path.insert(0, os.getcwd())  # the experiments live in the repository, not the package
    try:
        module = importlib.import_module(f"experiments.{name}")
    except ImportError as e:
        raise SystemExit(f"llmserve bench: cannot import experiments.{name} ({e}); run it from "
                         "the repository root") from e
    rest = argv[1:]
    if not any(a.startswith("--config") for a in rest):
        rest = [f"--config=configs/{name}.py"] + rest
    app.run(module.main, argv=[f"llmserve bench {name}"] + rest)


# ---------------------------------------------------------------------------------- main
def dashes_to_underscores(argv: list[str]) -> list[str]:
    """``--served-model-name=x`` -> ``--served_model_name=x`` (absl flag names)."""
    out = []
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            name, eq, value = a[2:].partition("=")
            a = "--" + name.replace("-", "_") + eq + value
        out.append(a)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    """Dispatches ``llmserve <subcommand> [flags]``."""
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in SUBCOMMANDS:
        print(__doc__.strip())
        raise SystemExit(0 if len(argv) >= 2 and argv[1] in ("-h", "--help") else 2)
    sub, rest = argv[1], argv[2:]
    if sub == "bench":
        bench(rest)
        return
    rest = [f"llmserve {sub}"] + dashes_to_underscores(rest)
    if sub == "serve":
        from llmserve import serve

        serve.define_flags()
        _run(serve.main, rest, serve)
    elif sub == "generate":
        _define_model_flags(max_tokens=96, temperature=0.0)
        flags.DEFINE_multi_string("prompt", None, "Chat prompt(s); default: a built-in handful.")
        _run(generate_main, rest, sys.modules[__name__])
    else:
        _define_model_flags(max_tokens=512, temperature=0.7)
        flags.DEFINE_string("system", None, "System prompt.")
        _run(chat_main, rest, sys.modules[__name__])


def entry() -> None:
    """The ``llmserve`` command: first re-executes itself with glibc's huge-page tunable when
    that helps (``llmserve.host_memory.reexec_with_hugepages``), then ``main``."""
    from llmserve.host_memory import reexec_with_hugepages

    reexec_with_hugepages()
    main()


def _run(fn, argv: list[str], module) -> None:
    """app.run, but ``--help`` lists the subcommand's own flags (not absl's and jax's)."""
    if "--help" in argv or "-h" in argv:
        print(f"{argv[0]}:\n{FLAGS.module_help(module)}")
        raise SystemExit(0)
    app.run(fn, argv=argv)
