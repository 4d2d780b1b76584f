"""Every notebook is committed executed, and runs top to bottom at small sizes.

The committed notebooks carry their outputs (run at their default sizes), so a reader sees the
results on the repository page; the test re-executes each one at small sizes
(``PERTURBKIT_NOTEBOOK_SMALL=1``). The notebooks check their own numbers
(``np.testing.assert_allclose`` in cells), so a failed comparison is a cell error here.

The notebooks a test process runs share one kernel (starting one and importing JAX costs
about 4 s, a third of a small notebook's run): before each notebook, ``%reset -f`` empties the
kernel's namespace, so a notebook that used a name it does not define (or import) itself
fails as in a fresh kernel. A kernel that died is replaced. A notebook that sets ``XLA_FLAGS``
(its own host CPU devices, read when JAX starts) gets a fresh kernel of its own.
"""
import gc
import pathlib

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from host_devices import child_environment

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / 'notebooks').glob('*.ipynb'))
TIMEOUT_S = 300
# Plots are saved as small PNGs (dpi 72); a notebook past this has grown a large output.
MAX_NOTEBOOK_BYTES = 300_000


def _ids(paths):
  return [p.stem for p in paths]


def test_notebooks_found():
  assert [p.name for p in NOTEBOOKS] == [
      '01_activation_gradients.ipynb', '02_interleaved_training.ipynb',
      '03_nested_gradients.ipynb', '04_real_model.ipynb', '05_nnx.ipynb', '06_kfac.ipynb',
      '07_private_training.ipynb', '08_interpretability.ipynb']


@pytest.mark.parametrize('path', NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_committed_executed(path):
  nb = nbformat.read(path, as_version=4)
  code = [cell for cell in nb.cells if cell.cell_type == 'code']
  # One run from the top in a fresh kernel numbers the code cells 1..n in order.
  assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), path.name
  for cell in code:
    errors = [out for out in cell.outputs if out.output_type == 'error']
    assert not errors, (path.name, cell.source[:80], errors)
  assert path.stat().st_size < MAX_NOTEBOOK_BYTES, (path.name, path.stat().st_size)


def _started_kernel(environment: dict[str, str]) -> KernelManager:
  manager = KernelManager(kernel_name='python3')
  manager.start_kernel(env=environment, cwd=str(NOTEBOOKS[0].parent))
  return manager


@pytest.fixture(scope='session')
def kernel():
  """``kernel(fresh)``: the kernel for the notebooks of this test process (a new one, the
  caller's to shut down, where ``fresh``), started with the small sizes.

  It inherits this process's environment (with conftest's cheaper XLA compile passes: at small
  sizes the notebooks spend most of their time compiling) but not its host device count: a
  notebook that wants several host devices sets its own. jupyter_client starts the 'python3'
  kernel with sys.executable, so it sees the same installed packages.
  """
  environment = {**child_environment(), 'PERTURBKIT_NOTEBOOK_SMALL': '1'}
  shared = []

  def started(fresh: bool) -> KernelManager:
    if fresh:
      return _started_kernel(environment)
    if not shared or not shared[0].is_alive():
      if shared:
        shared.pop().shutdown_kernel(now=True)
      shared.append(_started_kernel(environment))
    return shared[0]

  yield started
  if shared:
    shared[0].shutdown_kernel(now=True)


def run_small(path, kernel):
  """Runs the notebook at ``path`` top to bottom at its small sizes, in the shared kernel with
  its namespace emptied (in a fresh kernel, shut down after it, if it sets ``XLA_FLAGS``)."""
  nb = nbformat.read(path, as_version=4)
  first = next(cell for cell in nb.cells if cell.cell_type == 'code')
  assert 'PERTURBKIT_NOTEBOOK_SMALL' in first.source, 'the first code cell sets the sizes'
  fresh = 'XLA_FLAGS' in first.source
  manager = kernel(fresh)
  # This process's garbage-collector thresholds (conftest.py's), which a kernel does not take.
  nb.cells.insert(0, nbformat.v4.new_code_cell(
      f'%reset -f\nimport gc\ngc.set_threshold{gc.get_threshold()}\ndel gc'))
  client = NotebookClient(nb, km=manager, timeout=TIMEOUT_S, kernel_name='python3',
                          resources={'metadata': {'path': str(path.parent)}})
  try:
    client.execute()
  except CellExecutionError as error:
    pytest.fail(f'{path.name} failed:\n{error}')
  finally:
    if client.kc is not None:
      client.kc.stop_channels()
    if fresh:
      manager.shutdown_kernel(now=True)


def _class_name(path) -> str:
  return 'TestNotebook' + ''.join(part.title() for part in path.stem.split('_'))


def _runs_class(path):
  """``TestNotebook08Interpretability``: a class per notebook, so pytest-xdist (``--dist loadscope``) gives
  each notebook's run to whichever worker is free; a parametrized function would keep them all
  on one worker."""
  def test_runs(self, kernel):
    del self
    run_small(path, kernel)
  return type(_class_name(path), (), {'test_runs': test_runs, '__doc__': f'{path.name} runs.'})


for _path in NOTEBOOKS:
  globals()[_class_name(_path)] = _runs_class(_path)
