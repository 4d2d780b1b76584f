"""Strict JAX for every test, and XLA's cheaper CPU compile passes for a fast suite.

Rank promotion is an error, not a silent broadcast. The tiny test models spend most of
their time compiling; XLA's backend optimization level 0 and no expensive LLVM passes
about a third less CPU time there, with the same HLO (fusion and buffer assignment, so the
compiled-memory tests see the same bytes). Set before JAX starts its backend; flags the
environment already has (e.g. a device count) are kept.
"""
import os

FAST_COMPILE_FLAGS = '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
if 'xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)

jax.config.update('jax_numpy_rank_promotion', 'raise')

# pytest-xdist (``--dist loadscope``) runs each test file whole on one worker, so that its
# module fixtures compile each model once; the notebooks and benchmark scripts, a class
# each, go one by one. Files start longest first (as measured with --durations), so that no
# long file starts last while the other worker idles.
LONGEST_FIRST = (
    'test_real_models_per_example.py', 'test_notebooks.py', 'test_real_models.py',
    'test_per_example.py', 'test_benchmarks.py', 'test_kfac.py', 'test_nnx_kfac.py',
    'test_value_and_grad.py', 'test_dp_robustness.py', 'test_per_example_lifted.py',
    'test_interpret.py', 'test_nnx_per_example.py', 'test_threads_and_nesting.py',
    'test_nnx_interleaved.py', 'test_real_models_kfac.py', 'test_interpret_attribution.py',
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file
