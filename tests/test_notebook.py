"""The quickstart notebook executes top to bottom (its smoke configuration) and has no outputs."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


def test_notebook_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(PATH, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None


@pytest.mark.slow
def test_notebook_executes(tmp_path, monkeypatch):
    import nbclient
    import nbformat

    monkeypatch.setenv("LLMSERVE_NOTEBOOK_SMOKE", "1")
    monkeypatch.setenv("LLMSERVE_RESULTS", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(PATH, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.join(ROOT,
                                                                                  "notebooks")}})
    client.execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs)
    assert "same greedy tokens: True" in text
    images = [o for c in nb.cells for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "the ablation's plot is shown inline"
