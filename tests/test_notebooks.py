"""Every notebook runs top to bottom at small sizes, and is committed without outputs.

The notebooks check their own numbers (``np.testing.assert_allclose`` in cells), so a
failed comparison is a cell error here.
"""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / 'notebooks').glob('*.ipynb'))
TIMEOUT_S = 300


def _ids(paths):
  return [p.stem for p in paths]


def test_notebooks_found():
  assert [p.name for p in NOTEBOOKS] == [
      '01_activation_gradients.ipynb', '02_interleaved_training.ipynb',
      '03_nested_gradients.ipynb', '04_real_model.ipynb', '05_nnx.ipynb', '06_kfac.ipynb',
      '07_private_training.ipynb']


@pytest.mark.parametrize('path', NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_outputs_stripped(path):
  nb = nbformat.read(path, as_version=4)
  for cell in nb.cells:
    if cell.cell_type == 'code':
      assert cell.outputs == [] and cell.execution_count is None, (path.name, cell.source[:80])


@pytest.mark.parametrize('path', NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs(path, monkeypatch):
  nb = nbformat.read(path, as_version=4)
  first = next(cell for cell in nb.cells if cell.cell_type == 'code')
  assert 'PERTURBKIT_NOTEBOOK_SMALL' in first.source, 'the first code cell sets the sizes'
  # The kernel inherits this process's environment. jupyter_client starts the
  # 'python3' kernel with sys.executable, so it sees the same installed packages.
  monkeypatch.setenv('PERTURBKIT_NOTEBOOK_SMALL', '1')
  client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name='python3',
                          resources={'metadata': {'path': str(path.parent)}})
  try:
    client.execute()
  except CellExecutionError as error:
    pytest.fail(f'{path.name} failed:\n{error}')
