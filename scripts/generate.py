"""Chat with a model through the continuous-batching engine; `make demo` runs this.

    python scripts/generate.py                          # SmolLM2-135M-Instruct, built-in prompts
    python scripts/generate.py --model=/path/to/hf_dir --prompt="Hello" --max_tokens=64
    python scripts/generate.py --temperature=0.7 --top_p=0.9 --seed=1

The same as ``llmserve generate`` (llmserve/cli.py).
"""

import sys

from llmserve.cli import main
from llmserve.host_memory import reexec_with_hugepages

if __name__ == "__main__":
    reexec_with_hugepages()  # first: glibc reads its huge-page tunable only at process start
    main([sys.argv[0], "generate", *sys.argv[1:]])
