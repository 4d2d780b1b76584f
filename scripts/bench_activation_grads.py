"""Cost of activation gradients: perturbkit against plain jax.grad and hand-written perturb.

For an MLP, a CNN and a small Transformer, three jitted functions are measured
side by side in one run:

  plain         jax.value_and_grad of the loss w.r.t. params only (no activation grads).
  flax_perturb  the model rewritten with ``self.perturb`` at every submodule output; the
                zero perturbations are made outside jit and passed in as arrays; grad
                w.r.t. params and perturbations (the Flax guide's approach).
  perturbkit    ``perturbkit.value_and_grad(loss_fn)`` on the unmodified model.

Reported per variant: median step time (round-robin interleaved), ratios to
plain, lowering and compile time, and XLA's memory_analysis bytes. The script
also checks that flax_perturb and perturbkit give the same activation gradients,
and the same loss and params gradients as plain, and exits non-zero if not.

  python scripts/bench_activation_grads.py                  # default sizes
  python scripts/bench_activation_grads.py --sizes small    # smoke test, < 60 s
"""
import os
import sys
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

# Measure the checkout this script lives in, installed or not.
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]
import perturbkit  # noqa: E402
import _bench_common as common  # noqa: E402
import _bench_models as models  # noqa: E402

VARIANTS = ('plain', 'flax_perturb', 'perturbkit')
DEFAULT_OUT = os.path.join(SCRIPTS, 'results', 'bench_activation_grads.json')
TOLERANCE = dict(rtol=1e-4, atol=1e-6)
TIME_TARGET = 1.05  # perturbkit / plain
VS_FLAX_SLACK = 1.03  # perturbkit / flax_perturb; the allowance for timing noise

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    'small': {
        'mlp': dict(batch=32, features=64, widths=(128, 128), classes=10),
        'cnn': dict(batch=8, image=16, channels=(8, 16), convs_per_stage=1, classes=10),
        'transformer': dict(batch=4, seq=16, features=16, dim=32, depth=2, heads=2, classes=10),
    },
    'default': {
        'mlp': dict(batch=256, features=784, widths=(1024, 1024, 1024, 512), classes=10),
        'cnn': dict(batch=64, image=32, channels=(32, 64, 128), convs_per_stage=2, classes=10),
        'transformer': dict(batch=32, seq=64, features=32, dim=128, depth=4, heads=4,
                            classes=10),
    },
}


def make_problem(name: str, size: dict[str, Any], key: jax.Array) -> models.Problem:
  """The named model at ``size`` with a random batch."""
  if name == 'mlp':
    model = models.MLP(size['widths'], size['classes'])
    shape = (size['batch'], size['features'])
  elif name == 'cnn':
    model = models.CNN(size['channels'], size['convs_per_stage'], size['classes'])
    shape = (size['batch'], size['image'], size['image'], 3)
  elif name == 'transformer':
    model = models.Transformer(size['dim'], size['depth'], size['heads'], size['classes'])
    shape = (size['batch'], size['seq'], size['features'])
  else:
    raise ValueError(f'Unknown model {name!r}.')
  return models.random_problem(model, shape, size['classes'], key)


def plain_step(model: nn.Module) -> Callable[..., Any]:
  """(a) ``(params, x, y) -> (loss, {'params': grads})``."""
  loss_fn = models.cross_entropy(model)

  def step(params, x, y):
    loss, g = jax.value_and_grad(lambda p: loss_fn({'params': p}, x, y))(params)
    return loss, {'params': g}
  return step


def flax_perturb_step(model: nn.Module) -> Callable[..., Any]:
  """(b) ``(params, perturbations, x, y) -> (loss, grads)`` on the ``tap=True`` model."""
  loss_fn = models.cross_entropy(model.clone(tap=True))

  def step(params, perturbations, x, y):
    loss, (gp, gq) = jax.value_and_grad(
        lambda p, q: loss_fn({'params': p, 'perturbations': q}, x, y), argnums=(0, 1))(
            params, perturbations)
    return loss, {'params': gp, 'perturbations': gq}
  return step


def perturbkit_step(model: nn.Module) -> Callable[..., Any]:
  """(c) ``(variables, x, y) -> (loss, grads)`` on the unmodified model."""
  return perturbkit.value_and_grad(models.cross_entropy(model))


def step_args(problem: models.Problem, key: jax.Array) -> dict[str, tuple]:
  """The arguments of each variant; flax_perturb's zeros are made here, outside jit."""
  params = problem.model.init(key, problem.x)['params']
  zeros = problem.model.clone(tap=True).init(key, problem.x)['perturbations']
  zeros = jax.tree.map(jnp.zeros_like, zeros)
  return {
      'plain': (params, problem.x, problem.y),
      'flax_perturb': (params, zeros, problem.x, problem.y),
      'perturbkit': ({'params': params}, problem.x, problem.y),
  }


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {tuple(k.key for k in path): leaf for path, leaf in leaves}


def _close(actual: Any, expected: Any) -> str | None:
  """``None`` if the two trees match within ``TOLERANCE``, else the first mismatch."""
  return _close_flat(_flat(actual), _flat(expected))


def _close_flat(a: dict[tuple[str, ...], Any], e: dict[tuple[str, ...], Any]) -> str | None:
  """``_close`` for trees already flattened to ``{key path: leaf}``."""
  if set(a) != set(e):
    return f'different leaves: {sorted(set(a) ^ set(e))[:4]}'
  for path in sorted(e):
    try:
      np.testing.assert_allclose(np.asarray(a[path]), np.asarray(e[path]), **TOLERANCE)
    except AssertionError as err:
      worst = [ln.strip() for ln in str(err).splitlines() if ln.strip().startswith('Max')]
      return f'{"/".join(path)}: {"; ".join(worst)}'
  return None


def check_gradients(outputs: dict[str, Any]) -> dict[str, str | None]:
  """Mismatches between the variants' results, ``None`` where they agree.

  flax_perturb's perturbation keys are renamed to perturbkit's point paths with
  ``models.tap_name`` before comparing activation gradients.
  """
  (loss_a, g_a), (loss_b, g_b), (loss_c, g_c) = (outputs[v] for v in VARIANTS)
  renamed_b = {p: _flat(g_b['perturbations']).get(models.tap_name(p))
               for p in _flat(g_c['perturbations'])}
  missing = sorted(p for p, v in renamed_b.items() if v is None)
  extra = len(_flat(g_b['perturbations'])) - len(renamed_b)
  activations = (f'points missing from flax_perturb: {missing[:4]}' if missing else
                 f'{extra} flax_perturb points perturbkit lacks' if extra else
                 _close_flat(_flat(g_c['perturbations']), renamed_b))
  return {
      'loss': _close({'flax_perturb': loss_b, 'perturbkit': loss_c},
                     {'flax_perturb': loss_a, 'perturbkit': loss_a}),
      'params_flax_perturb_vs_plain': _close(g_b['params'], g_a['params']),
      'params_perturbkit_vs_plain': _close(g_c['params'], g_a['params']),
      'activations_perturbkit_vs_flax_perturb': activations,
  }


def measure_model(name: str, size: dict[str, Any], repeats: int,
                  key: jax.Array) -> dict[str, Any]:
  """Compiles, checks and times the three variants on one model."""
  kp, kd = jax.random.split(key)
  problem = make_problem(name, size, kd)
  args = step_args(problem, kp)
  steps = {'plain': plain_step(problem.model), 'flax_perturb': flax_perturb_step(problem.model),
           'perturbkit': perturbkit_step(problem.model)}
  compiled = {v: common.compile_timed(steps[v], *args[v]) for v in VARIANTS}
  outputs = {v: compiled[v].call(*args[v]) for v in VARIANTS}
  mismatches = check_gradients(outputs)
  samples = common.time_round_robin(
      {v: (lambda v=v: compiled[v].call(*args[v])) for v in VARIANTS}, repeats)
  variants = {v: {**common.summarize(samples[v]), 'lower_s': compiled[v].lower_s,
                  'compile_s': compiled[v].compile_s, **compiled[v].memory,
                  'samples_s': samples[v]} for v in VARIANTS}
  return {
      'size': {k: list(v) if isinstance(v, tuple) else v for k, v in size.items()},
      'num_params': sum(x.size for x in jax.tree.leaves(args['plain'][0])),
      'num_points': len(jax.tree.leaves(outputs['perturbkit'][1]['perturbations'])),
      'checks': {k: m is None for k, m in mismatches.items()},
      'mismatches': {k: m for k, m in mismatches.items() if m is not None},
      'ok': all(m is None for m in mismatches.values()),
      'variants': variants,
      **ratios_and_targets(variants),
  }


def total_bytes(variant: dict[str, Any]) -> int:
  """Argument + output + temp bytes: the buffers one step needs at once, at most."""
  return sum(variant.get(k, 0) for k in ('argument_bytes', 'output_bytes', 'temp_bytes'))


def ratios_and_targets(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """Time ratios and whether perturbkit meets its targets on this model."""
  t = {v: variants[v]['median_s'] for v in VARIANTS}
  mem = lambda v, field: variants[v].get(field, -1)
  ratios = {
      'perturbkit_over_plain': t['perturbkit'] / t['plain'],
      'flax_perturb_over_plain': t['flax_perturb'] / t['plain'],
      'perturbkit_over_flax_perturb': t['perturbkit'] / t['flax_perturb'],
  }
  targets = {
      f'time_perturbkit_le_{TIME_TARGET}x_plain': ratios['perturbkit_over_plain'] <= TIME_TARGET,
      'argument_bytes_perturbkit_eq_plain':
          mem('perturbkit', 'argument_bytes') == mem('plain', 'argument_bytes'),
      f'time_perturbkit_le_{VS_FLAX_SLACK}x_flax_perturb':
          ratios['perturbkit_over_flax_perturb'] <= VS_FLAX_SLACK,
      'argument_bytes_perturbkit_le_flax_perturb':
          mem('perturbkit', 'argument_bytes') <= mem('flax_perturb', 'argument_bytes'),
      'temp_bytes_perturbkit_le_flax_perturb':
          mem('perturbkit', 'temp_bytes') <= mem('flax_perturb', 'temp_bytes'),
      'total_bytes_perturbkit_le_flax_perturb':
          total_bytes(variants['perturbkit']) <= total_bytes(variants['flax_perturb']),
  }
  return {'ratios': ratios, 'targets_met': targets}


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
  """One printed row per model and variant."""
  rows = []
  for name, r in results.items():
    plain = r['variants']['plain']['median_s']
    for v in VARIANTS:
      m = r['variants'][v]
      rows.append({
          'model': name, 'variant': v,
          'median ms': f'{m["median_s"] * 1e3:.2f}',
          'p25-p75 ms': f'{m["p25_s"] * 1e3:.2f}-{m["p75_s"] * 1e3:.2f}',
          'x plain': f'{m["median_s"] / plain:.3f}',
          'lower s': f'{m["lower_s"]:.2f}', 'compile s': f'{m["compile_s"]:.2f}',
          'arg bytes': f'{m.get("argument_bytes", -1):,}',
          'temp bytes': f'{m.get("temp_bytes", -1):,}',
          'out bytes': f'{m.get("output_bytes", -1):,}',
          'check': ('OK' if r['ok'] else 'MISMATCH') if v == 'perturbkit' else '',
      })
  return rows


COLUMNS = ('model', 'variant', 'median ms', 'p25-p75 ms', 'x plain', 'lower s', 'compile s',
           'arg bytes', 'temp bytes', 'out bytes', 'check')

NOTE = """\
out bytes: flax_perturb and perturbkit also return dL/d(output) of every submodule call
(the 'perturbations' gradients), which plain does not compute as an output, so their
output bytes are larger than plain's by design. arg bytes: flax_perturb takes its zero
perturbations as arguments; perturbkit makes them inside the trace, so its arguments
should be exactly plain's."""


def report(results: dict[str, Any]) -> None:
  """Prints the table, the per-model checks and targets, and the note on output bytes."""
  print(common.format_table(table_rows(results), COLUMNS))
  print()
  for name, r in results.items():
    status, met = common.check_lines(r)
    print(f'{name}: {status} ({r["num_points"]} points, {r["num_params"]:,} params)')
    print(f'  targets: {met}')
  print()
  print(NOTE)


def main(argv: list[str] | None = None) -> int:
  args = common.parse_args(__doc__.split('\n')[0], SIZES, DEFAULT_OUT, 30, argv)
  results = common.measure_each(args.models, lambda name, key: measure_model(
      name, SIZES[args.sizes][name], args.repeats, key))
  report(results)
  config = {
      'sizes': args.sizes, 'repeats': args.repeats, 'tolerance': TOLERANCE,
      'variants': list(VARIANTS)}
  return common.write_checked(args.out, 'activation_grads', config, results)


if __name__ == '__main__':
  sys.exit(main())
