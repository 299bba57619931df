"""``python -m llmserve``: the ``llmserve`` command (see ``llmserve.cli``)."""

from llmserve.cli import main

if __name__ == "__main__":
    main()
