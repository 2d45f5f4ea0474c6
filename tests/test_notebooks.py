"""The Colab notebooks (notebooks/*.ipynb) run top to bottom on CPU, as a user would run them.

Each notebook executes in a fresh Jupyter kernel with the repository root as its working
directory and its run lengths shortened (SHORTER); a cell that raises fails the test, naming the
cell. Every notebook must draw at least one plot (an image/png output) and is committed with its
outputs stripped.
"""
import os
import re

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ("01_transformer_from_blocks", "02_translation", "03_bert", "04_flash_attention", "05_sharding",
             "06_captioning", "07_linear_time_mixers")
TIMEOUT_S = 300  # per cell; a whole notebook takes about a minute on two CPU cores
# Each notebook's first code cell sets the lengths of its runs (`TRAIN_STEPS` "scales the run"). The
# test runs every cell with these shorter ones: the same code paths, compiles and plots, with fewer
# steps of the same training loops (the notebooks assert nothing that depends on them).
SHORTER = {"01_transformer_from_blocks": {"TRAIN_STEPS": 20},
           "02_translation": {"TRAIN_STEPS": 20, "TRAIN_PAIRS": 500},
           "03_bert": {"PRETRAIN_STEPS": 12, "FINETUNE_STEPS": 5},
           "06_captioning": {"TRAIN_STEPS": 6},
           "07_linear_time_mixers": {"LENGTHS": (1024, 131072)}}


def _read(name):
    return nbformat.read(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), as_version=4)


def _shorten(nb, name):
    """Sets each SHORTER value in the one code cell that assigns it."""
    for variable, value in SHORTER.get(name, {}).items():
        assignment = re.compile(rf"^{variable} = .*$", re.M)
        cells = [c for c in nb.cells if c.cell_type == "code" and assignment.search(c.source)]
        assert len(cells) == 1, f"{name} assigns {variable} in {len(cells)} cells"
        cells[0].source = assignment.sub(f"{variable} = {value!r}", cells[0].source)


def _images(nb) -> int:
    return sum("image/png" in out.get("data", {})
               for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)


def test_every_notebook_is_tested():
    present = sorted(f[:-len(".ipynb")] for f in os.listdir(os.path.join(ROOT, "notebooks")) if f.endswith(".ipynb"))
    assert present == sorted(NOTEBOOKS)


def test_readme_links_every_notebook_to_colab():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Notebooks\n", 1)[1].split("\n## ", 1)[0]
    for name in NOTEBOOKS:
        url = f"https://colab.research.google.com/github/ORG/tfm/blob/main/notebooks/{name}.ipynb"
        assert url in section, f"README's Notebooks section has no Colab link to {name}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_outputs_are_stripped(name):
    nb = _read(name)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name} cell {i} has outputs"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch):
    # The kernel inherits this environment: one CPU device, as on a Colab CPU runtime (notebook 05
    # asks for its 8 simulated devices itself), and the inline backend, which draws PNGs with Agg.
    monkeypatch.setenv("XLA_FLAGS", xla_env.flags())
    monkeypatch.delenv("MPLBACKEND", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = _read(name)
    _shorten(nb, name)
    client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": ROOT}})
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{name}: a cell raised\n{str(e)[-3000:]}")
    assert _images(nb) >= 1, f"{name} drew no plot"
