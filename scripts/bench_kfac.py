"""Cost of a K-FAC step next to an adam step, and the memory of the factors.

For an MLP, a CNN, an unmodified Hugging Face GPT-2 (next-token loss at every
position; its FlaxConv1D projections get Kronecker factors, its LayerNorms their
diagonal, its tied ``wte`` the fallback) and a pre-norm Transformer classifier with
its blocks unrolled (``transformer``) or stacked in ``nn.scan`` (``transformer_scan``:
the same layers, with factors stacked per iteration), each variant's step is jitted
once and a timed sample runs
``--steps`` steps in a row, the state threaded through (so an inverse refreshed
every ``k`` steps is paid once per ``k`` steps, as in training). The steps are
not fused into one ``lax.scan``: XLA:CPU runs convolutions inside control flow
(a scan's loop, a ``lax.cond``) many times slower (a CNN Adam step 15x), which
would measure that and not the step. The variants are timed round-robin in one
run:

  adam                  jax.value_and_grad + optax.adam.
  kfac_sampled          the default: fisher='sampled' (a second backward lane at labels
                        sampled from the model, the true Fisher); statistics and inverses
                        every k steps (stats_every = inverse_every = k; the other steps
                        are a plain gradient and the preconditioning matmuls).
  kfac_empirical        the same with fisher='empirical' (the factors from the training
                        gradient's own backward pass).
  kfac_sampled_every    fisher='sampled' with the statistics taken every step
                        (stats_every=1, with_stats=True); inverses every k steps.
  kfac_precondition     no statistics and no refresh at all: a gradient and the
                        preconditioning by fixed inverses, the floor of any K-FAC step.
  interleaved_adam      perturbkit.interleaved (layer-wise segments, propagate='updated')
                        with adam in every segment.
  kfac_segments         the same sweep with perturbkit.kfac_segment + sgd in every K-FAC
                        layer's segment: the factors formed in each segment's backward,
                        statistics and inverses every k steps.
  kfac_host_switch      kfac_sampled without the lax.cond: two jitted steps, with_stats=True
                        and with_stats=False, picked in Python (the statistics one on every
                        k-th step, when the preconditioner's stats_due is true).

Reported: ms per step, the ratio to adam, the ratio of each K-FAC variant to
kfac_precondition (what the statistics and inverses add to a preconditioned
step), the cost of one refresh of all damped inverses (Cholesky), the bytes of
the factors and inverses next to those of the params and adam's state, and the
compiled memory of each variant's step (``memory_analysis()``: temp bytes).

  python scripts/bench_kfac.py --models mlp cnn --out scripts/results/bench_kfac.json
  python scripts/bench_kfac.py --models gpt2 --out scripts/results/bench_kfac_gpt2.json
  python scripts/bench_kfac.py --models transformer transformer_scan --repeats 10 \
      --out scripts/results/bench_kfac_scan.json
  python scripts/bench_kfac.py --sizes small --repeats 2      # smoke test; no JSON

On CPU, jax's Cholesky runs in the OpenBLAS that scipy ships; its threads spin
against XLA's own thread pool and made one refresh 50-400x slower on a loaded
2-core machine. The script sets ``OPENBLAS_NUM_THREADS=1`` unless it is set.
"""
import argparse
import logging
import os
import sys
import warnings
from typing import Any

os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

# Measure the checkout this script lives in, installed or not.
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]
import perturbkit  # noqa: E402
import _bench_common as common  # noqa: E402
import _bench_models as models  # noqa: E402
from perturbkit.kfac._preconditioner import layer_inverses  # noqa: E402

VARIANTS = ('adam', 'kfac_sampled', 'kfac_empirical', 'kfac_sampled_every', 'kfac_precondition',
            'interleaved_adam', 'kfac_segments', 'kfac_host_switch')
TIME_TARGET = 1.3  # kfac step / adam step, and / the preconditioned step, amortised over k
NEVER = 2 ** 30
# The update-then-propagate sweep with K-FAC segments diverged at the whole-model damping
# (1e-2, momentum 0.9) on the small MLP fitting one batch, where propagate='original' and
# whole-model K-FAC converged; 0.1 (as in notebook 06) was stable. The damping's value does
# not change the operations timed.
SEGMENT_DAMPING = 0.1

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    'small': {
        'mlp': dict(batch=32, features=64, widths=(64, 64), classes=10),
        'cnn': dict(batch=8, image=8, channels=(8, 16), convs_per_stage=1, classes=10),
        'gpt2': dict(batch=2, seq=8, layers=2, width=32, heads=2, vocab=64),
        'transformer': dict(batch=4, seq=8, features=8, dim=16, depth=2, heads=2, classes=10),
        'transformer_scan': dict(batch=4, seq=8, features=8, dim=16, depth=2, heads=2,
                                 classes=10),
    },
    'default': {
        'mlp': dict(batch=256, features=784, widths=(512, 512), classes=10),
        'cnn': dict(batch=32, image=16, channels=(16, 32), convs_per_stage=1, classes=10),
        'gpt2': dict(batch=8, seq=64, layers=4, width=128, heads=4, vocab=1024),
        'transformer': dict(batch=8, seq=32, features=32, dim=128, depth=4, heads=4,
                            classes=10),
        'transformer_scan': dict(batch=8, seq=32, features=32, dim=128, depth=4, heads=4,
                                 classes=10),
    },
}


class GPT2Logits(nn.Module):
  """Hugging Face's Flax GPT-2 with its LM head, unmodified: token ids to next-token logits."""
  config: Any

  @nn.compact
  def __call__(self, ids: jax.Array) -> jax.Array:
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModule
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return FlaxGPT2LMHeadModule(self.config, name='gpt2')(
        ids, jnp.ones_like(ids), positions, deterministic=True).logits


def gpt2_problem(size: dict[str, Any], key: jax.Array) -> models.Problem:
  """GPT-2 on random token ids; the labels are the ids shifted by one."""
  logging.getLogger('transformers').setLevel(logging.ERROR)
  warnings.filterwarnings('ignore', message='.*TensorFlow and JAX classes are deprecated.*')
  import transformers as T
  config = T.GPT2Config(vocab_size=size['vocab'], n_positions=size['seq'], n_embd=size['width'],
                        n_layer=size['layers'], n_head=size['heads'])
  ids = jax.random.randint(key, (size['batch'], size['seq'] + 1), 0, size['vocab'])
  return models.Problem(GPT2Logits(config), ids[:, :-1], ids[:, 1:])


def make_problem(name: str, size: dict[str, Any], key: jax.Array) -> models.Problem:
  """The named model at ``size`` with a random batch."""
  if name == 'gpt2':
    return gpt2_problem(size, key)
  if name == 'mlp':
    model = models.MLP(size['widths'], size['classes'])
    shape = (size['batch'], size['features'])
  elif name.startswith('transformer'):
    model = models.Transformer(size['dim'], size['depth'], size['heads'], size['classes'],
                               scan=name == 'transformer_scan')
    shape = (size['batch'], size['seq'], size['features'])
  else:
    model = models.CNN(size['channels'], size['convs_per_stage'], size['classes'])
    shape = (size['batch'], size['image'], size['image'], 3)
  return models.random_problem(model, shape, size['classes'], key)


def run_steps(compiled, carry, key: jax.Array, x, y, steps: int):
  """``steps`` calls of the compiled ``step(carry, key, x, y) -> (carry, loss)`` from
  ``carry``: ``(carry, losses)``. The batch is an argument, not a closed-over
  constant, so XLA cannot fold the input factors at compile time."""
  losses = []
  for step_key in jax.random.split(key, steps):
    carry, loss = compiled.call(carry, step_key, x, y)
    losses.append(loss)
  return carry, jnp.stack(losses)


def adam_run(problem: models.Problem):
  loss_fn = models.cross_entropy(problem.model)
  tx = optax.adam(1e-3)

  def step(carry, key, x, y):
    del key
    params, opt_state = carry
    loss, grads = jax.value_and_grad(lambda p: loss_fn({'params': p}, x, y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss
  return tx, step


def kfac_run(problem: models.Problem, layers: perturbkit.KFACLayers, fisher: str, k: int,
             stats_every: int | None, with_stats: bool | None = None):
  predict = lambda v, x: problem.model.apply(v, x)
  estimate = perturbkit.kfac_estimator(predict, 'softmax_cross_entropy', layers, fisher=fisher)
  tx = optax.chain(perturbkit.kfac_preconditioner(layers, damping=1e-2, inverse_every=k,
                                                  stats_every=stats_every),
                   optax.sgd(1e-2, momentum=0.9))

  def step(carry, key, x, y):
    params, opt_state = carry
    # A Python bool (every step, or a step picked in Python) needs no lax.cond.
    flag = with_stats if with_stats is not None else (
        True if stats_every == 1 else opt_state[0].stats_due)
    loss, grads, stats = estimate({'params': params}, x, y, key, with_stats=flag)
    updates, opt_state = tx.update(grads, opt_state, params, kfac_stats=stats)
    return (optax.apply_updates(params, updates), opt_state), loss
  return tx, step


def interleaved_run(problem: models.Problem, layers: perturbkit.KFACLayers | None, k: int):
  """``(init(params) -> state, run)`` of the interleaved sweep: adam in every segment, or
  kfac_segment + sgd in the K-FAC layers' segments when ``layers`` is given."""
  def optimizer(name):
    # An Embed's integer input does not reach the segment optimizer: adam there.
    if layers is None or name not in layers.layers or layers.layers[name].kind == 'embed':
      return optax.adam(1e-3)
    return optax.chain(perturbkit.kfac_segment(layers.layers[name], damping=SEGMENT_DAMPING,
                                               inverse_every=k),
                       optax.sgd(1e-2, momentum=0.9))

  tx = perturbkit.interleaved(models.cross_entropy(problem.model), optimizer)

  def step(state, key, x, y):
    del key
    state, metrics = tx.step(state, x, y)
    return state, metrics['loss']
  return (lambda params: tx.init({'params': params}, problem.x, problem.y)), step


class HostSwitch:
  """Two compiled steps picked in Python: the one with statistics on every ``k``-th call.

  Calls are counted from the state's count 0 and a timed sample is a multiple of
  ``k`` steps, so the statistics step runs exactly when ``stats_due`` is true.
  """

  def __init__(self, with_stats: common.CompiledFn, without: common.CompiledFn, k: int):
    self.with_stats, self.without, self.k, self.calls = with_stats, without, k, 0
    self.compile_s = with_stats.compile_s + without.compile_s
    self.memory = max(with_stats.memory, without.memory, key=lambda m: m.get('temp_bytes', 0))

  def call(self, *args):
    fn = self.with_stats if self.calls % self.k == 0 else self.without
    self.calls += 1
    return fn.call(*args)


def nbytes(tree: Any) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def measure_model(name: str, size: dict[str, Any], k: int, steps: int, repeats: int,
                  key: jax.Array) -> dict[str, Any]:
  """Compiles and times the variants on one model; factor and state bytes."""
  kp, kd, ks = jax.random.split(key, 3)
  problem = make_problem(name, size, kd)
  params = jax.jit(problem.model.init)(kp, problem.x)['params']
  predict = lambda v, x: problem.model.apply(v, x)
  layers = perturbkit.kfac_layers(predict, {'params': params}, problem.x)
  runs = {'adam': adam_run(problem),
          'kfac_sampled': kfac_run(problem, layers, 'sampled', k, None),
          'kfac_empirical': kfac_run(problem, layers, 'empirical', k, None),
          'kfac_sampled_every': kfac_run(problem, layers, 'sampled', k, 1),
          'kfac_precondition': kfac_run(problem, layers, 'sampled', NEVER, NEVER),
          'kfac_host_switch': kfac_run(problem, layers, 'sampled', k, None, with_stats=True)}
  states = {v: tx.init(params) for v, (tx, _) in runs.items()}
  for v, kfac_layers in (('interleaved_adam', None), ('kfac_segments', layers)):
    init, run = interleaved_run(problem, kfac_layers, k)
    states[v], runs[v] = init(params), (None, run)
  # Start past count 0 with no statistics due, so that this variant never takes them
  # and never refreshes the inverses.
  first = states['kfac_precondition'][0]._replace(count=jnp.ones((), jnp.int32),
                                                  stats_due=jnp.zeros((), bool))
  states['kfac_precondition'] = (first, *states['kfac_precondition'][1:])
  args = {v: ((params, states[v]), ks, problem.x, problem.y) for v in VARIANTS}
  args.update({v: (states[v], ks, problem.x, problem.y)
               for v in ('interleaved_adam', 'kfac_segments')})
  compiled = {v: common.compile_timed(runs[v][1], *args[v]) for v in VARIANTS}
  no_stats = kfac_run(problem, layers, 'sampled', k, None, with_stats=False)[1]
  compiled['kfac_host_switch'] = HostSwitch(
      compiled['kfac_host_switch'], common.compile_timed(no_stats, *args['kfac_host_switch']), k)
  losses = {v: run_steps(compiled[v], *args[v], steps)[1] for v in VARIANTS}
  finite = {v: bool(jnp.all(jnp.isfinite(losses[v]))) for v in VARIANTS}

  kfac_state = states['kfac_sampled'][0]
  refresh = jax.jit(lambda f: {n: layer_inverses(layers.layers[n], f[n], 1e-2) for n in f})
  inverse = common.compile_timed(refresh, kfac_state.factors)
  samples = common.time_round_robin(
      {**{v: (lambda v=v: run_steps(compiled[v], *args[v], steps)) for v in VARIANTS},
       'inverse_refresh': lambda: inverse.call(kfac_state.factors)}, repeats)
  per_step = {v: common.summarize([s / steps for s in samples[v]]) for v in VARIANTS}
  adam_s = per_step['adam']['median_s']
  ratios = {f'{v}_over_adam': per_step[v]['median_s'] / adam_s for v in VARIANTS[1:]}
  floor_s = per_step['kfac_precondition']['median_s']
  ratios.update({f'{v}_over_precondition': per_step[v]['median_s'] / floor_s
                 for v in (*VARIANTS[1:4], 'kfac_host_switch')})
  ratios['kfac_segments_over_interleaved_adam'] = (per_step['kfac_segments']['median_s'] /
                                                   per_step['interleaved_adam']['median_s'])
  refresh_s = common.summarize(samples['inverse_refresh'])['median_s']
  memory = {'params_bytes': nbytes(params), 'adam_state_bytes': nbytes(states['adam']),
            'factor_bytes': nbytes(kfac_state.factors),
            'inverse_bytes': nbytes(kfac_state.inverses)}
  return {
      'size': {k_: list(v) if isinstance(v, tuple) else v for k_, v in size.items()},
      'layers': {n: info.kind for n, info in layers.layers.items()},
      'skipped': layers.skipped,
      'finite_losses': finite,
      'first_and_last_loss': {v: [float(losses[v][0]), float(losses[v][-1])] for v in VARIANTS},
      'ok': all(finite.values()),
      'per_step': per_step,
      'compile_s': {v: compiled[v].compile_s for v in VARIANTS},
      'compiled_memory': {v: compiled[v].memory for v in VARIANTS},
      'inverse_refresh_s': refresh_s,
      'inverse_refresh_over_adam_step': refresh_s / adam_s,
      'ratios': ratios,
      'memory': {**memory, 'factors_and_inverses_over_params':
                 (memory['factor_bytes'] + memory['inverse_bytes']) / memory['params_bytes']},
      'targets_met': {
          **{f'{v}_le_{TIME_TARGET}x_adam': ratios[f'{v}_over_adam'] <= TIME_TARGET
             for v in ('kfac_sampled', 'kfac_empirical', 'kfac_host_switch')},
          **{f'{v}_le_{TIME_TARGET}x_precondition': ratios[f'{v}_over_precondition'] <=
             TIME_TARGET for v in ('kfac_sampled', 'kfac_empirical', 'kfac_host_switch')}},
  }


COLUMNS = ('model', 'variant', 'ms/step', 'p25-p75', 'x adam', 'x precond', 'temp MiB')


def report(results: dict[str, Any], k: int) -> None:
  rows = []
  for name, r in results.items():
    for v in VARIANTS:
      m = r['per_step'][v]
      rows.append({'model': name, 'variant': v, 'ms/step': f'{m["median_s"] * 1e3:.3f}',
                   'p25-p75': f'{m["p25_s"] * 1e3:.3f}-{m["p75_s"] * 1e3:.3f}',
                   'x adam': f'{m["median_s"] / r["per_step"]["adam"]["median_s"]:.2f}',
                   'x precond': (f'{m["median_s"] / r["per_step"]["kfac_precondition"]["median_s"]:.2f}'
                                 if v.startswith('kfac_') and v != 'kfac_segments' else '-'),
                   'temp MiB': f'{r["compiled_memory"][v].get("temp_bytes", 0) / 2**20:.1f}'})
  print(common.format_table(rows, COLUMNS))
  print()
  for name, r in results.items():
    mem = r['memory']
    print(f'{name}: one inverse refresh {r["inverse_refresh_s"] * 1e3:.2f} ms '
          f'({r["inverse_refresh_over_adam_step"]:.1f} adam steps; paid every {k} steps); '
          f'factors {mem["factor_bytes"] / 2**20:.2f} MiB + inverses '
          f'{mem["inverse_bytes"] / 2**20:.2f} MiB vs params {mem["params_bytes"] / 2**20:.2f} '
          f'MiB, adam state {mem["adam_state_bytes"] / 2**20:.2f} MiB')
    print('  targets: ' + ', '.join(f'{t}={"yes" if ok else "NO"}'
                                    for t, ok in r['targets_met'].items()))


def main(argv: list[str] | None = None) -> int:
  extra = argparse.ArgumentParser(add_help=False)
  extra.add_argument('--k', type=int, default=10, help='refresh the inverses every k steps')
  extra.add_argument('--steps', type=int, default=10, help='steps per timed sample')
  args = common.parse_args(__doc__.split('\n')[0], SIZES, None, 20, argv, parents=[extra])
  k, steps = args.k, args.steps
  if steps % k:
    raise SystemExit(f'--steps ({steps}) must be a multiple of --k ({k}): kfac_host_switch '
                     'counts its calls to know when the statistics are due.')
  results = common.measure_each(args.models, lambda name, key: measure_model(
      name, SIZES[args.sizes][name], k, steps, args.repeats, key))
  report(results, k)
  return common.write_checked(
      args.out, 'kfac', {'sizes': args.sizes, 'repeats': args.repeats, 'k': k, 'steps': steps,
                         'variants': list(VARIANTS), 'time_target': TIME_TARGET}, results)


if __name__ == '__main__':
  sys.exit(main())
