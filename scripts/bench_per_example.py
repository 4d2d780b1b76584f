"""Cost of DP-SGD: perturbkit's one-pass clipping against ``vmap(grad)`` clipping and a plain step.

For an MLP, a CNN and a small Transformer at two batch sizes, four jitted
training steps (SGD) are compiled and timed side by side in one run, round-robin (vmap_grad
after the other three, whose caches its large working set would otherwise evict):

  plain       ``jax.value_and_grad`` + ``optax.sgd``: the non-private step.
  noised      the plain step plus the Gaussian noise σC of DP-SGD (perturbkit's own draw,
              ``add_noise``), without clipping: the floor of any DP-SGD step. On CPU, JAX
              draws threefry random numbers with rolled loops, so for a small model the
              noise alone can cost more than the plain step.
  vmap_grad   per-example gradients by ``jax.vmap(jax.grad)`` of each example's loss,
              clipped to C, summed, Gaussian noise σC added, averaged, then SGD.
  perturbkit  ``perturbkit.dp_sgd``: norms from the (input, output gradient) pairs of
              one backward pass, clipped sum by one VJP per layer call (book-keeping).

Reported: median step time and its ratio to plain, XLA ``memory_analysis`` bytes
(argument + output + temp) and their ratio to plain; perturbkit's ratios to noised
(what per-example clipping adds on top of the noise). Before timing, the two private
steps are checked to give the same new params for the same key (exit code 1 if not).

  python scripts/bench_per_example.py --out scripts/results/bench_per_example.json
  python scripts/bench_per_example.py --sizes small      # prints only
  python scripts/bench_per_example.py --sizes tiny --models mlp cnn   # the smoke test's run

``--sizes 124m`` measures an unmodified Hugging Face GPT-2 small (124M params, its LM head tied
to the token embedding) at batch 8, sequence 128, instead of the three models
(``--sizes gpt2_tiny``: the same code on a one-block GPT-2):

  python scripts/bench_per_example.py --sizes 124m --repeats 5

``--api nnx`` measures the same four steps on the NNX versions of the models
(``_bench_nnx_models``): ``nnx.value_and_grad`` for plain and noised, ``jax.vmap`` of
``nnx.grad`` for vmap_grad, ``perturbkit.nnx.dp_sgd`` for perturbkit; the same JSON,
with ``config['api']``:

  python scripts/bench_per_example.py --api nnx --sizes tiny
"""
import argparse
import os
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

# Measure the checkout this script lives in, installed or not.
SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(SCRIPTS), SCRIPTS]
import perturbkit  # noqa: E402
from flax import nnx  # noqa: E402
import _bench_common as common  # noqa: E402
import _bench_models as models  # noqa: E402
import _bench_nnx_models as nnx_models  # noqa: E402

VARIANTS = ('plain', 'noised', 'vmap_grad', 'perturbkit')
LEARNING_RATE = 0.1
CLIP_NORM = 1.0
NOISE_MULTIPLIER = 1.0
TOLERANCE = dict(rtol=1e-4, atol=1e-6)
TARGETS = {'time': 1.5, 'memory': 1.2}  # perturbkit / plain
DEFAULT_OUT = os.path.join(SCRIPTS, 'results', 'bench_per_example.json')

SIZES: dict[str, dict[str, dict[str, Any]]] = {
    'tiny': {  # the smoke test: one batch size, seconds
        'mlp': dict(batches=(4,), features=8, widths=(16,), classes=3),
        'cnn': dict(batches=(3,), image=6, channels=(4,), classes=3),
        'transformer': dict(batches=(2,), seq=4, features=4, dim=8, depth=1, heads=2,
                            classes=3),
    },
    'small': {
        'mlp': dict(batches=(8, 16), features=16, widths=(32, 32), classes=10),
        'cnn': dict(batches=(4, 8), image=8, channels=(8, 8), classes=10),
        'transformer': dict(batches=(2, 4), seq=8, features=8, dim=16, depth=1, heads=2,
                            classes=10),
    },
    'default': {
        'mlp': dict(batches=(64, 256), features=128, widths=(512, 512), classes=10),
        'cnn': dict(batches=(64, 256), image=16, channels=(16, 32), classes=10),
        'transformer': dict(batches=(64, 256), seq=32, features=16, dim=64, depth=2, heads=4,
                            classes=10),
    },
    # Hugging Face GPT-2 small (124M params, tied LM head), as in bench_real_models.py.
    '124m': {'gpt2': dict(batches=(8,), layers=12, width=768, heads=12, seq=128,
                          vocab=50257)},
    'gpt2_tiny': {'gpt2': dict(batches=(3,), layers=1, width=16, heads=2, seq=8, vocab=32)},
}
GPT2_SIZES = ('124m', 'gpt2_tiny')


def make_problem(name: str, size: dict[str, Any], batch: int, key: jax.Array) -> models.Problem:
  if name == 'mlp':
    model, shape = models.MLP(size['widths'], size['classes']), (batch, size['features'])
  elif name == 'cnn':
    model = models.CNN(size['channels'], 1, size['classes'])
    shape = (batch, size['image'], size['image'], 3)
  elif name == 'transformer':
    model = models.Transformer(size['dim'], size['depth'], size['heads'], size['classes'])
    shape = (batch, size['seq'], size['features'])
  else:
    raise ValueError(f'Unknown model {name!r}.')
  return models.random_problem(model, shape, size['classes'], key)


def gpt2_case(size: dict[str, Any], batch: int,
              key: jax.Array) -> tuple[Callable[..., jax.Array], Any, jax.Array, jax.Array]:
  """Unmodified HF GPT-2 (``bench_real_models.gpt2_problem``) as ``(loss, params, x, y)``.

  ``x`` is the token ids, ``y`` the mask and positions stacked on axis 1: both come in as
  batched arguments (ids made inside the loss would be shared constants, not per-example
  inputs), in the two-argument form the steps here take.
  """
  from bench_real_models import gpt2_problem, quiet_transformers
  quiet_transformers()
  problem = gpt2_problem({**size, 'positions': 0, 'batch': batch}, key)
  ids, mask, positions = problem.batch

  def loss_fn(variables, ids, extra):
    return problem.loss_fn(variables, ids, extra[:, 0], extra[:, 1])

  return loss_fn, problem.variables['params'], ids, jnp.stack([mask, positions], axis=1)


def plain_step(loss_fn: Callable[..., jax.Array], optimizer) -> Callable[..., Any]:
  def step(params, opt_state, key, x, y):
    del key
    loss, grads = jax.value_and_grad(lambda p: loss_fn({'params': p}, x, y))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def noised_step(loss_fn: Callable[..., jax.Array], optimizer) -> Callable[..., Any]:
  """The plain step with DP-SGD's noise added to the summed gradient, and no clipping."""
  def step(params, opt_state, key, x, y):
    loss, grads = jax.value_and_grad(lambda p: loss_fn({'params': p}, x, y))(params)
    batch = x.shape[0]
    summed = jax.tree.map(lambda g: g * batch, grads)
    noised = perturbkit.per_example._dp.add_noise(
        key, summed, jnp.asarray(NOISE_MULTIPLIER * CLIP_NORM, jnp.float32))
    grads = jax.tree.map(lambda g: g / batch, noised)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def vmap_grad_step(loss_fn: Callable[..., jax.Array], optimizer) -> Callable[..., Any]:
  """DP-SGD the usual JAX way: a batch of per-example gradients in memory."""
  def step(params, opt_state, key, x, y):
    one = lambda xi, yi: jax.grad(lambda p: loss_fn({'params': p}, xi[None], yi[None]))(params)
    per_example = jax.vmap(one)(x, y)
    sq = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1)
             for g in jax.tree.leaves(per_example))
    factors = CLIP_NORM / jnp.maximum(jnp.sqrt(sq), CLIP_NORM)
    summed = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1), per_example)
    noise = perturbkit.per_example._dp.gaussian_noise(  # the same draws, to compare results
        key, summed, jnp.asarray(NOISE_MULTIPLIER * CLIP_NORM, jnp.float32))
    grads = jax.tree.map(lambda s, n: (s + n) / x.shape[0], summed, noise)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss_fn({'params': params}, x, y)
  return step


def perturbkit_step(loss_fn: Callable[..., jax.Array], optimizer) -> Callable[..., Any]:
  tx = perturbkit.dp_sgd(loss_fn, optimizer, clip_norm=CLIP_NORM,
                         noise_multiplier=NOISE_MULTIPLIER)

  def step(params, opt_state, key, x, y):
    state = perturbkit.PrivateState(jnp.zeros((), jnp.int32), {'params': params}, opt_state)
    state, metrics = tx.step(state, key, x, y)
    return state.variables['params'], state.opt_state, metrics['loss']
  return step


# -- the NNX steps: params are the nnx.State of nnx.Param, the rest of the state fixed ---------


def nnx_model(name: str, size: dict[str, Any], shape: tuple, seed: int) -> nnx.Module:
  rngs = nnx.Rngs(seed)
  if name == 'mlp':
    return nnx_models.MLP(size['features'], size['widths'], size['classes'], rngs=rngs)
  if name == 'cnn':
    return nnx_models.CNN(size['image'], shape[-1], size['channels'], 1, size['classes'],
                          rngs=rngs)
  return nnx_models.Transformer(size['features'], size['dim'], size['depth'], size['heads'],
                                size['classes'], rngs=rngs)


def nnx_loss(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def nnx_steps(graphdef: Any, others: Any, optimizer) -> dict[str, Callable[..., Any]]:
  """The four steps ``(params, opt_state, key, x, y) -> (params, opt_state, loss)``."""
  model_of = lambda params: nnx.merge(graphdef, params, others, copy=True)
  sigma = jnp.asarray(NOISE_MULTIPLIER * CLIP_NORM, jnp.float32)

  def update(params, opt_state, grads, loss):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def plain(params, opt_state, key, x, y):
    del key
    loss, grads = nnx.value_and_grad(nnx_loss)(model_of(params), x, y)
    return update(params, opt_state, grads, loss)

  def noised(params, opt_state, key, x, y):
    loss, grads = nnx.value_and_grad(nnx_loss)(model_of(params), x, y)
    batch = x.shape[0]
    summed = jax.tree.map(lambda g: g * batch, grads)
    noised = perturbkit.per_example._dp.add_noise(key, summed, sigma)
    return update(params, opt_state, jax.tree.map(lambda g: g / batch, noised), loss)

  def vmap_grad(params, opt_state, key, x, y):
    def one(params, xi, yi):
      return nnx.grad(nnx_loss)(model_of(params), xi[None], yi[None])
    per_example = jax.vmap(one, in_axes=(None, 0, 0))(params, x, y)
    sq = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1)
             for g in jax.tree.leaves(per_example))
    factors = CLIP_NORM / jnp.maximum(jnp.sqrt(sq), CLIP_NORM)
    summed = jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1), per_example)
    noise = perturbkit.per_example._dp.gaussian_noise(key, summed, sigma)  # the same draws
    grads = jax.tree.map(lambda s, n: (s + n) / x.shape[0], summed, noise)
    return update(params, opt_state, grads, nnx_loss(model_of(params), x, y))

  tx = perturbkit.nnx.dp_sgd(nnx_loss, optimizer, clip_norm=CLIP_NORM,
                             noise_multiplier=NOISE_MULTIPLIER)

  def private(params, opt_state, key, x, y):
    state = perturbkit.nnx.NNXPrivateState(jnp.zeros((), jnp.int32),
                                           *nnx.split(model_of(params)), opt_state)
    state, metrics = tx.step(state, key, x, y)
    return nnx.state(state.model(), nnx.Param), state.opt_state, metrics['loss']

  return {'plain': plain, 'noised': noised, 'vmap_grad': vmap_grad, 'perturbkit': private}


def mismatch(a: Any, b: Any) -> str | None:
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    try:
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOLERANCE)
    except AssertionError as err:
      return f'{jax.tree_util.keystr(path)}: {str(err).strip().splitlines()[-1]}'
  return None


def linen_steps(loss_fn: Callable[..., jax.Array], optimizer) -> dict[str, Callable[..., Any]]:
  makers = {'plain': plain_step, 'noised': noised_step, 'vmap_grad': vmap_grad_step,
            'perturbkit': perturbkit_step}
  return {v: makers[v](loss_fn, optimizer) for v in VARIANTS}


def measure(name: str, size: dict[str, Any], batch: int, repeats: int,
            key: jax.Array, api: str = 'linen') -> dict[str, Any]:
  kp, kd, kn = jax.random.split(key, 3)
  optimizer = optax.sgd(LEARNING_RATE)
  if name == 'gpt2':
    if api == 'nnx':
      raise SystemExit('GPT-2 is a Hugging Face Linen model: measure it with --api linen.')
    loss_fn, params, x, y = gpt2_case(size, batch, kd)
    steps = linen_steps(loss_fn, optimizer)
  elif api == 'nnx':
    problem = make_problem(name, size, batch, kd)
    x, y = problem.x, problem.y
    graphdef, params, others = nnx.split(
        nnx_model(name, size, problem.x.shape, int(jax.random.randint(kp, (), 0, 2 ** 30))),
        nnx.Param, ...)
    steps = nnx_steps(graphdef, others, optimizer)
  else:
    problem = make_problem(name, size, batch, kd)
    x, y = problem.x, problem.y
    params = problem.model.init(kp, x)['params']
    steps = linen_steps(models.cross_entropy(problem.model), optimizer)
  opt_state = optimizer.init(params)
  args = (params, opt_state, kn, x, y)
  compiled = {v: common.compile_timed(steps[v], *args) for v in VARIANTS}
  new_params = {v: compiled[v].call(*args)[0] for v in ('vmap_grad', 'perturbkit')}
  wrong = mismatch(new_params['perturbkit'], new_params['vmap_grad'])
  # vmap(grad) is timed on its own after the others: its working set (up to hundreds of MB)
  # evicts theirs, and taken in turn with them it slowed every step by up to 2x.
  thunks = {v: (lambda c=compiled[v]: c.call(*args)) for v in VARIANTS}
  samples = common.time_round_robin({v: thunks[v] for v in VARIANTS if v != 'vmap_grad'},
                                    repeats)
  samples.update(common.time_round_robin({'vmap_grad': thunks['vmap_grad']}, repeats))
  variants = {}
  for v in VARIANTS:
    memory = compiled[v].memory
    total = sum(memory.get(k, 0) for k in ('argument_bytes', 'output_bytes', 'temp_bytes'))
    variants[v] = {**common.summarize(samples[v]), **memory, 'sum_bytes': total,
                   'compile_s': compiled[v].lower_s + compiled[v].compile_s,
                   'samples_s': samples[v]}
  base = variants['plain']
  ratios = {f'{v}_{k}': variants[v][f] / base[f]
            for v in VARIANTS[1:] for k, f in (('time', 'median_s'), ('memory', 'sum_bytes'))}
  ratios.update({f'perturbkit_over_noised_{k}': variants['perturbkit'][f] / variants['noised'][f]
                 for k, f in (('time', 'median_s'), ('memory', 'sum_bytes'))})
  return {'batch': batch, 'num_params': sum(p.size for p in jax.tree.leaves(params)),
          'private_steps_agree': wrong is None, 'mismatch': wrong, 'variants': variants,
          'ratios': ratios,
          'targets_met': {
              f'time_le_{TARGETS["time"]}x_plain': ratios['perturbkit_time'] <= TARGETS['time'],
              f'memory_le_{TARGETS["memory"]}x_plain':
                  ratios['perturbkit_memory'] <= TARGETS['memory'],
              'faster_than_vmap_grad': ratios['perturbkit_time'] < ratios['vmap_grad_time'],
              'smaller_than_vmap_grad':
                  ratios['perturbkit_memory'] < ratios['vmap_grad_memory']}}


COLUMNS = ('model', 'batch', 'variant', 'median ms', 'x time', 'arg+out+temp MB', 'x mem',
           'compile s', 'check')


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
  rows = []
  for name, runs in results.items():
    for r in runs:
      base = r['variants']['plain']
      for v in VARIANTS:
        m = r['variants'][v]
        rows.append({
            'model': name, 'batch': r['batch'], 'variant': v,
            'median ms': f'{m["median_s"] * 1e3:.2f}',
            'x time': f'{m["median_s"] / base["median_s"]:.2f}',
            'arg+out+temp MB': f'{m["sum_bytes"] / 2**20:.2f}',
            'x mem': f'{m["sum_bytes"] / base["sum_bytes"]:.2f}',
            'compile s': f'{m["compile_s"]:.2f}',
            'check': ('OK' if r['private_steps_agree'] else 'MISMATCH')
                     if v == 'perturbkit' else ''})
  return rows


def main(argv: list[str] | None = None) -> int:
  front_end = argparse.ArgumentParser(add_help=False)
  front_end.add_argument('--api', choices=('linen', 'nnx'), default='linen',
                         help='the Flax API of the models and of perturbkit\'s functions')
  args = common.parse_args(__doc__.split('\n')[0], SIZES, DEFAULT_OUT, 15, argv,
                           parents=[front_end])
  key = jax.random.key(0)
  results: dict[str, list] = {}
  names = ['gpt2'] if args.sizes in GPT2_SIZES else args.models
  for i, name in enumerate(names):
    size = SIZES[args.sizes][name]
    results[name] = []
    for batch in size['batches']:
      print(f'[{name} batch {batch}] compiling, checking and timing ...', flush=True)
      results[name].append(measure(name, size, batch, args.repeats,
                                   jax.random.fold_in(key, 1000 * i + batch), args.api))
  print(common.format_table(table_rows(results), COLUMNS))
  print()
  for name, runs in results.items():
    for r in runs:
      met = ', '.join(f'{k}={"yes" if ok else "NO"}' for k, ok in r['targets_met'].items())
      over = r['ratios']
      print(f'{name} batch {r["batch"]}: {met}; perturbkit / noised: '
            f'{over["perturbkit_over_noised_time"]:.2f}x time, '
            f'{over["perturbkit_over_noised_memory"]:.2f}x memory'
            + (f'  MISMATCH {r["mismatch"]}' if r['mismatch'] else ''))
  all_ok = all(r['private_steps_agree'] for runs in results.values() for r in runs)
  print(f'\nperturbkit == vmap_grad: {"OK" if all_ok else "MISMATCH"}')
  print(f'x time, x mem: ratio to plain. Targets for perturbkit: time <= {TARGETS["time"]}x, '
        f'arg+out+temp bytes <= {TARGETS["memory"]}x.')
  common.write_results(args.out, 'per_example',
                       {'api': args.api, 'sizes': args.sizes, 'repeats': args.repeats,
                        'clip_norm': CLIP_NORM,
                        'noise_multiplier': NOISE_MULTIPLIER,
                        'optimizer': f'sgd({LEARNING_RATE})', 'tolerance': TOLERANCE,
                        'targets': TARGETS, 'variants': list(VARIANTS)},
                       results, all_ok)
  return 0 if all_ok else 1


if __name__ == '__main__':
  sys.exit(main())
