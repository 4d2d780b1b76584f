"""The demo's runs, table and plots; see ``help(perturbkit.demo)``."""
import argparse
import os
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import perturbkit
from perturbkit.demo._digits import Digits, SmallCNN, accuracy, cross_entropy, load_digits

RUNS = ('standard', 'interleaved (updated)', 'interleaved (original)')
PROBE_SIZE = 256


class StandardState(NamedTuple):
  """State of the standard run: the model variables and the optax state."""
  variables: dict
  opt_state: Any


class History(NamedTuple):
  """What one run recorded.

  Attributes:
    losses: Training loss of every step.
    step_ms: Wall time of every step in milliseconds (compilation excluded).
    test_accuracy: Test accuracy after every epoch.
    layer_norms: ``{layer: [norm per recorded step]}``, activation-gradient norms.
    layer_steps: The steps at which ``layer_norms`` were recorded.
  """
  losses: list
  step_ms: list
  test_accuracy: list
  layer_norms: dict
  layer_steps: list


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command-line flags; ``--quick`` shrinks the run to a few seconds."""
  parser = argparse.ArgumentParser(prog='python -m perturbkit.demo', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--epochs', type=int, default=20)
  parser.add_argument('--lr', type=float, default=None,
                      help='learning rate (default: 3e-3 for adam, 0.03 for sgd, 0.02 for momentum; '
                      "with much larger sgd steps the 'updated' schedule diverges on this model)")
  parser.add_argument('--optimizer', choices=('sgd', 'adam', 'momentum'), default='adam')
  parser.add_argument('--batch-size', type=int, default=64)
  parser.add_argument('--out', default='./demo_out', help='folder for the PNGs')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--quick', action='store_true',
                      help='a tiny run (3 epochs on a subset), for tests')
  parser.add_argument('--api', choices=('linen', 'nnx'), default='linen',
                      help='train the Linen model or its Flax NNX twin')
  return parser.parse_args(argv)


def make_optimizer(name: str, lr: float | None) -> optax.GradientTransformation:
  """The optax optimizer named on the command line, with its default learning rate.

  Example:
    >>> tx = make_optimizer('momentum', None)
    >>> sorted(tx._fields)
    ['init', 'update']
  """
  if name == 'adam':
    return optax.adam(3e-3 if lr is None else lr)
  if name == 'sgd':
    return optax.sgd(0.03 if lr is None else lr)
  if name == 'momentum':
    return optax.sgd(0.02 if lr is None else lr, momentum=0.9)
  raise ValueError(f'Unknown optimizer {name!r}.')


def make_loss_fn(model: SmallCNN) -> Callable[..., jax.Array]:
  """``loss_fn(variables, x, y)``: the ordinary loss on the unmodified model."""
  def loss_fn(variables, x, y):
    return cross_entropy(model.apply(variables, x), y)
  return loss_fn


def make_standard_step(loss_fn: Callable[..., jax.Array], optimizer: optax.GradientTransformation):
  """The usual jitted training step, for comparison with the interleaved ones."""
  @jax.jit
  def step(state: StandardState, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(state.variables, x, y)
    updates, opt_state = optimizer.update(grads['params'], state.opt_state,
                                          state.variables['params'])
    params = optax.apply_updates(state.variables['params'], updates)
    return StandardState({**state.variables, 'params': params}, opt_state), {'loss': loss}
  return step


def make_probe(loss_fn: Callable[..., jax.Array]) -> Callable[..., dict]:
  """A jitted ``(variables, x, y) -> {layer: norm}`` of the activation gradients."""
  value_and_grad = perturbkit.value_and_grad(loss_fn)

  @jax.jit
  def probe(variables, x, y):
    _, grads = value_and_grad(variables, x, y)
    return {name: jnp.linalg.norm(point['__call__'])
            for name, point in grads['perturbations'].items()}
  return probe


def batches(num_examples: int, batch_size: int, epoch_seed: int) -> Iterator[np.ndarray]:
  """Index arrays of one shuffled epoch; the last incomplete batch is dropped so
  that every step has the same shape (one compilation).

  Example:
    >>> [len(idx) for idx in batches(10, 4, epoch_seed=0)]
    [4, 4]
  """
  order = np.random.default_rng(epoch_seed).permutation(num_examples)
  for start in range(0, num_examples - batch_size + 1, batch_size):
    yield order[start:start + batch_size]


def evaluate(model: SmallCNN, variables: dict, x: np.ndarray, y: np.ndarray) -> float:
  """Accuracy of ``model`` on ``(x, y)``."""
  return float(accuracy(model.apply(variables, x), y))


def train(step: Callable, state: Any, data: Digits, model: SmallCNN, *, epochs: int,
          batch_size: int, seed: int, name: str,
          probe: Callable[..., dict] | None = None, probe_every: int = 5) -> tuple[Any, History]:
  """Runs ``step(state, x, y) -> (state, metrics)`` over ``epochs`` epochs.

  Per-layer activation-gradient norms come from ``metrics['activation_grad_norm']``
  when the step reports them, else from ``probe`` every ``probe_every`` steps on
  a fixed slice of the training set (outside the timed step).
  """
  history = History([], [], [], {}, [])
  probe_x, probe_y = data.x_train[:PROBE_SIZE], data.y_train[:PROBE_SIZE]
  steps_per_epoch = len(data.x_train) // batch_size
  with tqdm(total=epochs * steps_per_epoch, desc=name, unit='step', leave=True) as bar:
    for epoch in range(epochs):
      for idx in batches(len(data.x_train), batch_size, seed * 1000 + epoch):
        start = time.perf_counter()
        state, metrics = step(state, data.x_train[idx], data.y_train[idx])
        loss = float(jax.block_until_ready(metrics['loss']))
        history.step_ms.append(1e3 * (time.perf_counter() - start))
        history.losses.append(loss)
        norms = metrics.get('activation_grad_norm')
        if norms is None and probe is not None and len(history.losses) % probe_every == 1:
          norms = probe(state.variables, probe_x, probe_y)
        if norms is not None:
          history.layer_steps.append(len(history.losses))
          for layer, value in norms.items():
            history.layer_norms.setdefault(layer, []).append(float(value))
        bar.update()
        bar.set_postfix(loss=f'{loss:.3f}', epoch=epoch + 1, refresh=False)
      history.test_accuracy.append(evaluate(model, state.variables, data.x_test, data.y_test))
  # The first step includes compilation.
  history.step_ms[0] = float('nan')
  return state, history


def summarize(history: History, batch_size: int, steps_per_epoch: int) -> dict:
  """Final test accuracy, mean train loss of the last epoch and median step time."""
  return {'test_accuracy': history.test_accuracy[-1],
          'train_loss': float(np.mean(history.losses[-steps_per_epoch:])),
          'median_step_ms': float(np.nanmedian(history.step_ms))}


def format_table(results: dict) -> str:
  """The results as an aligned text table.

  Example:
    >>> print(format_table({'standard': {'test_accuracy': 0.95, 'train_loss': 0.1,
    ...                                  'median_step_ms': 1.5}}))
    run                       test acc  train loss   step ms
    --------------------------------------------------------
    standard                     95.0%      0.1000      1.50
  """
  header = f"{'run':<24} {'test acc':>9} {'train loss':>11} {'step ms':>9}"
  rows = [header, '-' * len(header)]
  for name, r in results.items():
    rows.append(f"{name:<24} {100 * r['test_accuracy']:>8.1f}% {r['train_loss']:>11.4f} "
                f"{r['median_step_ms']:>9.2f}")
  return '\n'.join(rows)


def _pyplot():
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  return plt


def _smooth(values: Sequence[float], window: int) -> np.ndarray:
  window = max(1, min(window, len(values)))
  kernel = np.ones(window) / window
  return np.convolve(np.asarray(values), kernel, mode='valid')


# propagate='original' equals the standard step, so its curve is drawn dashed on top.
_STYLES = ({'color': 'C0', 'linewidth': 3.0, 'alpha': 0.6},
           {'color': 'C1', 'linewidth': 1.5},
           {'color': 'C2', 'linewidth': 1.5, 'linestyle': '--'})


def plot_loss_curves(histories: dict, steps_per_epoch: int, title: str, path: str) -> str:
  """Training loss per step (raw and smoothed) and test accuracy per epoch."""
  plt = _pyplot()
  from matplotlib.ticker import MaxNLocator
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
  for (name, history), style in zip(histories.items(), _STYLES):
    steps = np.arange(1, len(history.losses) + 1)
    ax_loss.plot(steps, history.losses, color=style['color'], alpha=0.15, linewidth=0.8)
    smooth = _smooth(history.losses, steps_per_epoch)
    ax_loss.plot(steps[len(steps) - len(smooth):], smooth, label=name, **style)
    epochs = np.arange(1, len(history.test_accuracy) + 1)
    ax_acc.plot(epochs, 100 * np.asarray(history.test_accuracy), marker='o', markersize=4,
                label=name, **style)
  ax_loss.set(yscale='log', xlabel='training step', ylabel='training loss (cross-entropy)',
              title='Training loss (faint: per step; bold: one-epoch moving average)')
  ax_acc.set(xlabel='epoch', ylabel='test accuracy (%)', title='Test accuracy after each epoch')
  ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
  for ax in (ax_loss, ax_acc):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(title)
  return _save(plt, fig, path)


def _save(plt, fig, path: str) -> str:
  """Lays out, writes and closes a figure (no figure stays open in a notebook); its path."""
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_heatmap(history: History, title: str, path: str) -> str:
  """Per-segment activation-gradient norms over training (log colour scale)."""
  plt = _pyplot()
  from matplotlib.colors import LogNorm
  layers = list(history.layer_norms)
  norms = np.array([history.layer_norms[layer] for layer in layers])
  fig, ax = plt.subplots(figsize=(12, 3.8))
  steps = np.asarray(history.layer_steps)
  image = ax.imshow(norms, aspect='auto', interpolation='nearest',
                    norm=LogNorm(vmin=norms.min(), vmax=norms.max()), cmap='viridis',
                    extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5))
  ax.set_yticks(range(len(layers)), layers)
  ax.set(xlabel='training step', ylabel='layer (input at top)', title=title)
  fig.colorbar(image, ax=ax, label='||dL / d(layer output)||  (log scale)')
  return _save(plt, fig, path)


def plot_layer_norms(history: History, title: str, path: str) -> str:
  """One line per layer: activation-gradient norm against training step."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(9, 4.5))
  for layer, values in history.layer_norms.items():
    ax.plot(history.layer_steps, values, label=layer)
  ax.set(yscale='log', xlabel='training step', ylabel='||dL / d(layer output)||', title=title)
  ax.grid(alpha=0.3)
  ax.legend(title='layer', loc='upper left', bbox_to_anchor=(1.01, 1.0))
  return _save(plt, fig, path)


def shrink(data: Digits, train: int, test: int) -> Digits:
  """A subset of ``data``, for ``--quick``."""
  return Digits(data.x_train[:train], data.y_train[:train], data.x_test[:test], data.y_test[:test])


def run_all(args: argparse.Namespace, data: Digits) -> tuple[dict, dict]:
  """Trains the three runs from the same initial variables; returns histories and states."""
  model = SmallCNN()
  loss_fn = make_loss_fn(model)
  optimizer = make_optimizer(args.optimizer, args.lr)
  variables = model.init(jax.random.key(args.seed), data.x_train[:1])
  if getattr(args, 'api', 'linen') == 'nnx':
    from perturbkit.demo import _nnx as _nnx_demo
    example = (data.x_train[:args.batch_size], data.y_train[:args.batch_size])
    histories, states = {}, {}
    for name, (step, state, evaluator, probe) in _nnx_demo.runs(
        variables['params'], optimizer, example, RUNS).items():
      states[name], histories[name] = train(
          step, state, data, evaluator, epochs=args.epochs, batch_size=args.batch_size,
          seed=args.seed, name=name, probe=probe)
    return histories, states
  steps = {
      RUNS[0]: (make_standard_step(loss_fn, optimizer),
                StandardState(variables, optimizer.init(variables['params']))),
  }
  for name, propagate in zip(RUNS[1:], ('updated', 'original')):
    tx = perturbkit.interleaved(loss_fn, optimizer, propagate=propagate)
    example = (data.x_train[:args.batch_size], data.y_train[:args.batch_size])
    steps[name] = (jax.jit(tx.step), tx.init(variables, *example))
  histories, states = {}, {}
  for name, (step, state) in steps.items():
    probe = make_probe(loss_fn) if name == RUNS[0] else None
    states[name], histories[name] = train(
        step, state, data, model, epochs=args.epochs, batch_size=args.batch_size,
        seed=args.seed, name=name, probe=probe)
  return histories, states


def main(argv: Sequence[str] | None = None) -> dict:
  """Runs the demo; returns ``{'results': {run: metrics}, 'plots': [paths], 'table': str}``."""
  args = parse_args(argv)
  data = load_digits(seed=args.seed)
  if args.quick:
    args.epochs = min(args.epochs, 3)
    data = shrink(data, train=640, test=200)
  steps_per_epoch = len(data.x_train) // args.batch_size
  if steps_per_epoch < 1:
    raise perturbkit.InvalidOptionError(
        '--batch-size', args.batch_size,
        f'at most the {len(data.x_train)} training images (with --quick)' if args.quick else
        f'at most the {len(data.x_train)} training images')
  histories, _ = run_all(args, data)
  results = {name: summarize(h, args.batch_size, steps_per_epoch)
             for name, h in histories.items()}
  table = format_table(results)
  print(f'\n{args.api}, {args.optimizer}, {args.epochs} epochs, batch {args.batch_size}, '
        f'{steps_per_epoch} steps/epoch, {jax.devices()[0].platform}\n{table}')

  os.makedirs(args.out, exist_ok=True)
  setting = (f"{'NNX ' if args.api == 'nnx' else ''}SmallCNN on digits, {args.optimizer}, "
             f'batch {args.batch_size}')
  plots = [
      plot_loss_curves(histories, steps_per_epoch, f'Standard vs interleaved training ({setting})',
                       os.path.join(args.out, 'loss_curves.png')),
      plot_heatmap(histories[RUNS[1]],
                   'Activation-gradient norm per segment, interleaved (updated) run, '
                   "from metrics['activation_grad_norm']",
                   os.path.join(args.out, 'activation_grad_heatmap.png')),
      plot_layer_norms(histories[RUNS[0]],
                       'Standard run: activation-gradient norms from perturbkit.value_and_grad\n'
                       f'(first {PROBE_SIZE} training images)',
                       os.path.join(args.out, 'standard_activation_grads.png')),
  ]
  print('plots: ' + ', '.join(plots))
  return {'results': results, 'plots': plots, 'table': table}

