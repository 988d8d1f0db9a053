"""Runs notebooks/quickstart.ipynb and stores it with its outputs, so that a code host shows its results and plot.

    python notebooks/save_outputs.py

It runs the notebook as tests/test_notebook.py does (a kernel on this interpreter, this checkout's
sparkdl), then keeps what a reader needs and nothing that bloats or dates the file:

- stderr is dropped: it holds the JVM's and TensorFlow's start-up lines, not results;
- each live progress bar (an ipywidgets widget, whose state a code host cannot render) is stored as
  the text of its final state, and the widgets' state is left out;
- the notebook keeps its own kernel spec, not the test's, and no execution timestamps.
"""

import html
import sys
import tempfile
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_notebook import NOTEBOOK, execute_notebook  # noqa: E402  the run the test makes

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def progress_text(widget_id: str, widgets: dict) -> str:
    """A tqdm notebook bar (HBox of description, FloatProgress, statistics) as the text tqdm prints in a terminal."""
    children = [widgets[child.removeprefix("IPY_MODEL_")]["state"] for child in widgets[widget_id]["state"]["children"]]
    bar = next(child for child in children if "max" in child)
    # tqdm pads the HTML with figure spaces (U+2007) and escapes it.
    left, right = (html.unescape(child["value"]).replace("\u2007", " ") for child in children if "max" not in child)
    filled = round(10 * bar["value"] / bar["max"]) if bar["max"] else 0
    return f"{left}|{'█' * filled}{' ' * (10 - filled)}|{right}"


def readable(notebook: nbformat.NotebookNode, kernelspec: dict) -> nbformat.NotebookNode:
    widgets = notebook.metadata.pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for output in cell.outputs:
            if output.output_type == "stream" and output.name == "stderr":
                continue
            if WIDGET_VIEW in output.get("data", {}):
                output.data = {"text/plain": progress_text(output.data[WIDGET_VIEW]["model_id"], widgets)}
            outputs.append(output)
        cell.outputs = outputs
        cell.metadata.pop("execution", None)  # nbclient's timestamps
    notebook.metadata.kernelspec = kernelspec
    return notebook


def main() -> None:
    kernelspec = nbformat.read(NOTEBOOK, as_version=4).metadata.kernelspec
    with tempfile.TemporaryDirectory() as workdir:
        notebook = execute_notebook(Path(workdir))
    nbformat.write(readable(notebook, kernelspec), NOTEBOOK)
    print(f"saved {NOTEBOOK} ({NOTEBOOK.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
