"""Chat with a model through the continuous-batching engine; `make demo` runs this.

    python scripts/generate.py                          # SmolLM2-135M-Instruct, built-in prompts
    python scripts/generate.py --model=/path/to/hf_dir --prompt="Hello" --max_tokens=64
    python scripts/generate.py --temperature=0.7 --top_p=0.9 --seed=1
"""

import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "HF directory or .gguf file (default: SmolLM2-135M-Instruct).")
flags.DEFINE_multi_string("prompt", None, "Chat prompt(s); default: a built-in handful.")
flags.DEFINE_integer("max_tokens", 96, "New tokens per answer.")
flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling.")
flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.DEFINE_integer("max_num_seqs", 8, "Slots (concurrent sequences).")
flags.DEFINE_string("backend", None, "Attention backend: xla | pallas | reference.")

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


def main(argv):
    del argv
    from llmserve import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=FLAGS.model, max_num_seqs=FLAGS.max_num_seqs, max_model_len=1024,
              backend=FLAGS.backend)
    print(f"loaded and compiled in {time.time() - t0:.1f}s "
          f"({llm.config.n_layers} layers, {llm.config.n_heads}/{llm.config.n_kv_heads} heads)")
    questions = FLAGS.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=FLAGS.temperature, top_p=FLAGS.top_p, seed=FLAGS.seed,
                            max_tokens=FLAGS.max_tokens)
    t0 = time.time()
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
    dt = time.time() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for q, o in zip(questions, outs):
        print(f"\n>>> {q}\n{o.outputs[0].text.strip()}")
    print(f"\n{len(outs)} requests, {n} generated tokens in {dt:.1f}s: {n / dt:.1f} tokens/s "
          f"(continuous batching, {FLAGS.max_num_seqs} slots, fp32, CPU)")


if __name__ == "__main__":
    app.run(main)
