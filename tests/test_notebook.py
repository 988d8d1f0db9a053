"""notebooks/quickstart.ipynb runs headless from top to bottom, and its results hold up.

The notebook starts its own SparkSession in its own kernel process, so this test does not use the
session-wide ``spark`` fixture.
"""

import base64
import os
import re
from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
MODES = ("sync", "async", "average")

# Executes the whole notebook in its own kernel and Spark: the slow command.
pytestmark = pytest.mark.slow


def execute_notebook(workdir: Path) -> nbformat.NotebookNode:
    """Runs every cell in a kernel on this interpreter; nbclient raises CellExecutionError on the first failing cell."""
    # A kernel spec of our own: "python3" could resolve to another interpreter's spec (user-level kernels come first).
    kernels = workdir / "kernels"
    write_kernel_spec(kernels / "sparkdl-test", overrides={"display_name": "sparkdl test"})
    km = AsyncKernelManager(
        kernel_name="sparkdl-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
    )
    # The kernel and its Spark workers import this checkout's sparkdl, not whichever one is installed.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, km=km, timeout=300, startup_timeout=120, resources={"metadata": {"path": str(workdir)}}
    )
    client.execute(env=env)
    return notebook


def tagged_cell(notebook, tag):
    (cell,) = [c for c in notebook.cells if tag in c.metadata.get("tags", [])]
    return cell


def stdout_of(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def results_of(cell, mime, output_type):
    return [o.data[mime] for o in cell.outputs if o.output_type == output_type and mime in o.data]


def progress_bars(notebook):
    """The final state of every ipywidgets progress bar, as nbclient stores it in the notebook's metadata."""
    widgets = notebook.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    return [w["state"] for w in widgets.get("state", {}).values() if w["model_name"] == "FloatProgressModel"]


def test_quickstart_notebook(tmp_path):
    notebook = execute_notebook(tmp_path)

    accuracy = re.search(r"Test accuracy: ([0-9.]+)", stdout_of(tagged_cell(notebook, "evaluation")))
    assert accuracy, "the evaluation cell printed no test accuracy"
    assert float(accuracy.group(1)) > 0.9

    (png,) = results_of(tagged_cell(notebook, "training-curves"), "image/png", "display_data")
    assert base64.b64decode(png).startswith(b"\x89PNG")

    (table,) = results_of(tagged_cell(notebook, "modes"), "text/plain", "execute_result")
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:]}  # after the header lines
    assert set(rows) == set(MODES)
    for mode, (seconds, test_accuracy) in rows.items():
        assert float(seconds) > 0, mode
        assert float(test_accuracy) > 0.8, mode  # 5 epochs reach 0.9-0.97 here

    assert "Reloaded predictions agree: True" in stdout_of(tagged_cell(notebook, "save-load"))

    # Each fit showed a live Jupyter progress widget (not text), and every one ran to its last step:
    # the pipeline fit plus the warm-up and three mode fits.
    assert (
        len(results_of(tagged_cell(notebook, "modes"), "application/vnd.jupyter.widget-view+json", "display_data")) == 4
    )
    bars = progress_bars(notebook)
    assert len(bars) == 5
    assert all(bar["value"] == bar["max"] > 0 and bar["bar_style"] == "success" for bar in bars), bars
