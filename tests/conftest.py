"""Strict JAX, 8 host CPU devices, XLA's cheaper CPU compile passes, one compilation cache, a
less frequent Python garbage collector and property tests that draw the same examples each run.

Rank promotion is an error, not a silent broadcast.

Every test process has 8 host CPU devices (``--xla_force_host_platform_device_count=8``;
a device count the environment's ``XLA_FLAGS`` already has is kept instead), so the
multi-device checks run in the test process itself, on a mesh from ``host_devices.py``.
Single-device code runs on the first device as usual, measured to cost nothing. The
pytest-xdist workers import this file before jax too; the notebooks' kernels and benchmark
scripts the tests start inherit the environment, the devices included.

The tiny test models spend most of their time compiling. XLA's backend optimization level 0
and no expensive LLVM passes take about a third less CPU time there, with the same HLO;
XLA:CPU's older fusion emitters (``--xla_cpu_use_fusion_emitters=false``) take about half
the remaining compile time, with the same fusions but temp buffers a few percent apart, so
compiled-memory tests compare two functions compiled under the same flags, never bytes
against a fixed number. One LLVM module per program (``--xla_cpu_parallel_codegen_split_count=1``)
takes about a fifth less CPU time than splitting it for threads that, with a test process per
core, have no core of their own. The flags are set before JAX starts its backend; flags the
environment already has are kept.

The test processes (the pytest-xdist workers, and the notebooks' kernels, benchmark
scripts and child processes they start, which inherit the environment) share one
JAX compilation cache, made empty for this run and removed at its end: a computation
compiled in one process (the same model's step, or one eager op on the same shapes) is
read from it in the others. Nothing is kept from one run to the next. A process that
reads an entry another one is still writing gets a truncated entry; JAX then warns
(``setup.cfg`` does not turn that warning into an error) and compiles it itself.

Tracing a program makes many short-lived Python objects (tracers, jaxpr equations), so at
CPython's default thresholds (700, 10, 10) the cyclic garbage collector ran about 1,700 times
for 3 small test files, 5-7% of their CPU time. At (50,000, 20, 20) it runs a few dozen times,
with the same peak memory (1.48 GB for 4 files either way).
"""
import gc
import os
import shutil
import tempfile

import hypothesis

FAST_COMPILE_FLAGS = ('--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true '
                      '--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1')
HOST_DEVICES_FLAG = '--xla_force_host_platform_device_count=8'


def _with_flags(flags: str) -> str:
  """``flags`` with the cheaper compile passes and the host devices, where it lacks them."""
  if 'xla_backend_optimization_level' not in flags:
    flags += f' {FAST_COMPILE_FLAGS}'
  if 'xla_force_host_platform_device_count' not in flags:
    flags += f' {HOST_DEVICES_FLAG}'
  return flags.strip()


gc.set_threshold(50_000, 20, 20)

# The property tests draw the same examples on every run, so a run's result does not depend on
# chance; `--hypothesis-profile=explore` draws new ones on each run to look for failures.
hypothesis.settings.register_profile('perturbkit', derandomize=True, database=None)
hypothesis.settings.register_profile('explore', database=None)
hypothesis.settings.load_profile('perturbkit')
os.environ['XLA_FLAGS'] = _with_flags(os.environ.get('XLA_FLAGS', ''))

_OWN_CACHE = None
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix='perturbkit-test-jax-cache-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _OWN_CACHE
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'

import jax  # noqa: E402  (after XLA_FLAGS)

jax.config.update('jax_numpy_rank_promotion', 'raise')

# pytest-xdist (``--dist loadscope``) runs each test file whole on one worker, so that its
# module fixtures compile each model once; the notebooks and benchmark scripts, a class
# each, go one by one. Files start longest first (as measured with --durations), so that no
# long file starts last while the other worker idles.
LONGEST_FIRST = (
    'test_real_models_per_example.py', 'test_interpret.py', 'test_real_models.py',
    'test_per_example.py', 'test_interpret_scan.py', 'test_interpret_real_models.py',
    'test_real_models_kfac.py', 'test_nnx_interleaved.py', 'test_real_models_more.py',
    'test_nnx.py', 'test_interleaved_scan.py', 'test_shard_map_checked.py', 'test_kfac.py',
    'test_nnx_kfac.py', 'test_interleaved.py', 'test_value_and_grad.py',
    'test_interpret_attribution.py', 'test_dp_robustness.py', 'test_nnx_per_example.py',
    'test_kfac_norms.py', 'test_benchmarks.py', 'test_kfac_segment.py',
    'test_per_example_lifted.py', 'test_notebooks.py', 'test_kfac_scan.py',
    'test_nnx_per_example_lifted.py', 'test_per_example_reads.py', 'test_readme.py',
    'test_demo.py',
)


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE is not None:  # the process that made the cache (the controller) removes it
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
