"""``python -m llmserve``: the ``llmserve`` command (see ``llmserve.cli``)."""

from llmserve.cli import entry

if __name__ == "__main__":
    entry()
