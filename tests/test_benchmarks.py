"""Every benchmark script runs at its smallest size, writes its JSON, and its checks pass.

No timing is asserted (the numbers depend on the machine and are noise at these
sizes). What is asserted can fail: each script's own correctness checks (its
variants give the same losses, gradients or params as the reference it times
them against), the structure of the JSON the README's tables are made from, and
that every ratio was measured.
"""
import contextlib
import functools
import importlib
import io
import json
import os
import sys

import jax


SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'scripts')


def _run(script: str, args: list[str], out) -> tuple[str, dict]:
  """Runs ``script``'s ``main`` in this process (JAX and the models are imported once per
  worker, not once per script), with the default rank promotion a script run sees."""
  if SCRIPTS not in sys.path:
    sys.path.insert(0, SCRIPTS)
  module = importlib.import_module(script.removesuffix('.py'))
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed), jax.numpy_rank_promotion('allow'):
    code = module.main([*args, '--out', str(out)])
  assert code == 0, printed.getvalue()[-3000:]
  return printed.getvalue(), json.loads(out.read_text())


def check_activation_grads(stdout: str, data: dict):
  variant_keys = {'median_s', 'p25_s', 'p75_s', 'lower_s', 'compile_s', 'argument_bytes',
                  'output_bytes', 'temp_bytes', 'samples_s'}
  checks = {'loss', 'params_flax_perturb_vs_plain', 'params_perturbkit_vs_plain',
            'activations_perturbkit_vs_flax_perturb'}
  assert data['all_ok'] is True
  assert data['config']['sizes'] == 'small'
  assert set(data['models']) == {'mlp', 'cnn', 'transformer'}
  for name, model in data['models'].items():
    assert model['ok'] is True, (name, model['mismatches'])
    assert set(model['checks']) == checks and all(model['checks'].values()), name
    assert model['num_points'] > 0
    assert set(model['variants']) == {'plain', 'flax_perturb', 'perturbkit'}
    for variant in model['variants'].values():
      assert variant_keys <= set(variant), name
      assert len(variant['samples_s']) == 2
    assert set(model['ratios']) == {'perturbkit_over_plain', 'flax_perturb_over_plain',
                                    'perturbkit_over_flax_perturb'}
    assert model['targets_met'], name
  assert stdout.count(': OK (') == 3, stdout


def check_interleaved(stdout: str, data: dict):
  variant_keys = {'median_s', 'p25_s', 'p75_s', 'samples_s', 'lower_s', 'compile_s',
                  'total_compile_s', 'temp_bytes', 'argument_bytes', 'output_bytes', 'sum_bytes',
                  'ops'}
  assert 'original == standard: OK' in stdout
  assert data['benchmark'] == 'interleaved'
  assert data['config']['sizes'] == 'tiny' and data['config']['repeats'] == 2
  assert data['all_ok'] is True
  # Block segments (transformer); the script's other models run through the same harness.
  assert set(data['models']) == {'transformer'}
  for name, model in data['models'].items():
    assert set(model) == {'size', 'depths', 'targets_met'}, name
    assert model['targets_met']['original_equals_standard'] is True, name
    depths = [d['depth'] for d in model['depths']]
    assert depths == sorted(depths) and len(depths) >= 2, name
    segments = [d['segments'] for d in model['depths']]
    assert segments == sorted(set(segments)), name  # deeper models have more segments
    for d in model['depths']:
      assert d['original_equals_standard'] is True and d['mismatch'] is None, (name, d['depth'])
      assert set(d['variants']) == {'standard', 'updated', 'original'}
      for v, m in d['variants'].items():
        assert variant_keys <= set(m), (name, d['depth'], v, variant_keys - set(m))
        assert len(m['samples_s']) == 2
        assert m['median_s'] > 0 and m['total_compile_s'] > 0
      for v in ('updated', 'original'):
        for ratio in ('time', 'compile', 'sum_bytes', 'compile_s_per_segment'):
          assert d['ratios'][f'{v}_{ratio}'] > 0, (name, d['depth'], v, ratio)


KFAC_VARIANTS = ['adam', 'kfac_sampled', 'kfac_empirical', 'kfac_sampled_every',
                 'kfac_precondition', 'interleaved_adam', 'kfac_segments', 'kfac_host_switch']


def check_kfac(stdout: str, data: dict):
  del stdout
  assert data['benchmark'] == 'kfac' and data['all_ok'] is True
  assert data['config']['variants'] == KFAC_VARIANTS and data['config']['k'] == 10
  mlp = data['models']['mlp']
  assert mlp['layers'] == {'Dense_0': 'dense', 'Dense_1': 'dense', 'Dense_2': 'dense'}
  assert mlp['finite_losses'] == {v: True for v in KFAC_VARIANTS}
  for v, (first, last) in mlp['first_and_last_loss'].items():
    # kfac_precondition times the preconditioning with its initial inverses and never
    # refreshes them: it measures a cost, it is not meant to train.
    if v != 'kfac_precondition':
      assert last < first, (v, first, last)
  assert set(mlp['per_step']) == set(KFAC_VARIANTS)
  assert all(m['median_s'] > 0 for m in mlp['per_step'].values())
  assert all(mlp['compiled_memory'][v]['temp_bytes'] >= 0 for v in KFAC_VARIANTS)
  assert mlp['memory']['factor_bytes'] == mlp['memory']['inverse_bytes'] > 0
  assert all(r > 0 for r in mlp['ratios'].values())


def check_per_example(stdout: str, data: dict, api: str = 'linen',
                      models: tuple[str, ...] = ('mlp', 'cnn')):
  variants = ['plain', 'noised', 'vmap_grad', 'perturbkit']
  variant_keys = {'median_s', 'p25_s', 'p75_s', 'samples_s', 'compile_s', 'argument_bytes',
                  'output_bytes', 'temp_bytes', 'sum_bytes'}
  ratios = {f'{v}_{k}' for v in variants[1:] for k in ('time', 'memory')}
  ratios |= {'perturbkit_over_noised_time', 'perturbkit_over_noised_memory'}
  # The script compares perturbkit's DP-SGD step with the vmap(grad) one (same key, same
  # noise) and exits 1 if their new params differ.
  assert 'perturbkit == vmap_grad: OK' in stdout
  assert data['benchmark'] == 'per_example'
  assert data['config']['sizes'] == 'tiny' and data['config']['repeats'] == 2
  assert data['config']['variants'] == variants
  assert data['config'].get('api', 'linen') == api
  assert data['all_ok'] is True
  assert set(data['models']) == set(models)
  for name, runs in data['models'].items():
    assert [r['batch'] for r in runs] == [4 if name == 'mlp' else 3], name
    for r in runs:
      assert r['private_steps_agree'] is True and r['mismatch'] is None, (name, r['mismatch'])
      assert set(r['variants']) == set(variants), name
      for v, m in r['variants'].items():
        assert variant_keys <= set(m), (name, v, variant_keys - set(m))
        assert len(m['samples_s']) == 2 and m['median_s'] > 0 and m['sum_bytes'] > 0
      assert set(r['ratios']) == ratios and all(x > 0 for x in r['ratios'].values()), name
      assert set(r['targets_met']) == {'time_le_1.5x_plain', 'memory_le_1.2x_plain',
                                       'faster_than_vmap_grad', 'smaller_than_vmap_grad'}


def check_real_models(stdout: str, data: dict):
  variants = {'plain', 'perturbkit', 'standard', 'interleaved', 'original', 'blocks'}
  checks = {'loss_perturbkit_vs_plain', 'params_grad_perturbkit_vs_plain',
            'original_step_vs_standard'}
  ratios = {'perturbkit_over_plain', 'interleaved_over_standard', 'original_over_standard',
            'blocks_over_standard', 'interleaved_sum_bytes_over_standard',
            'original_sum_bytes_over_standard', 'blocks_sum_bytes_over_standard',
            'interleaved_compile_over_standard', 'blocks_compile_over_standard'}
  assert 'checks: OK' in stdout, stdout[-3000:]
  assert data['benchmark'] == 'real_models'
  assert data['config']['quick'] is True
  assert data['all_ok'] is True
  # GPT-2 alone: the script's ViT runs the same code on another model, and the real-model
  # tests check ViT itself.
  assert set(data['models']) == {'gpt2'}
  for name, model in data['models'].items():
    assert model['ok'] is True and model['mismatches'] == {}, (name, model['mismatches'])
    assert set(model['checks']) == checks and all(model['checks'].values()), name
    assert model['num_points'] > 10, name
    assert set(model['variants']) == variants, name
    for v, m in model['variants'].items():
      assert m['total_compile_s'] > 0 and m['argument_bytes'] > 0, (name, v)
      assert len(m['samples_s']) == 2 and m['median_s'] > 0, (name, v)
    assert set(model['ratios']) == ratios and all(r > 0 for r in model['ratios'].values())
    assert model['targets_met']['argument_bytes_perturbkit_eq_plain'] is True, name
    segments = [row['segments'] for row in model['compile_vs_segments']]
    assert segments == sorted(segments) and segments[0] == 0, name
    # Layer-wise default segments are finer than one segment per block.
    assert len(model['segments']['interleaved']) > len(model['segments']['blocks']) >= 1, name
  # GPT-2's LM head reads the token embedding (tied weights): it is updated at the end.
  assert list(data['models']['gpt2']['rest']) == ['transformer/wte']


def check_interventions(stdout: str, data: dict):
  variant_keys = {'median_s', 'p25_s', 'p75_s', 'samples_s', 'queued_median_s', 'queued_p25_s',
                  'queued_p75_s', 'queued_samples_s', 'lower_s', 'compile_s',
                  'argument_bytes', 'output_bytes', 'temp_bytes'}
  assert data['benchmark'] == 'interventions'
  assert data['config']['sizes'] == 'tiny' and data['config']['repeats'] == 2
  assert data['all_ok'] is True
  assert set(data['models']) == {'gpt2'}
  model = data['models']['gpt2']
  # The script's own checks: the sweep equals the loop of single patched runs, attribution
  # patching equals vdot with jax.grad of explicit deltas (by hand), and the corruption matters.
  assert model['ok'] is True and model['mismatches'] == {}, model['mismatches']
  assert model['checks'] == {'sweep_vs_loop': True, 'sweep_all_vs_loop': True,
                             'loop_needed_vs_loop': True, 'attribution_vs_vdot_grad': True,
                             'attribution_blocks_vs_vdot_grad': True}
  size = model['size']
  assert model['patched_runs'] == size['layers'] * size['seq']
  # The corrupted token is at a quarter of the sequence: the patches before it (every block)
  # are the corrupted run itself.
  assert model['patched_runs_needed'] == size['layers'] * (size['seq'] - size['seq'] // 4)
  assert model['attribution_calls'] > size['layers']
  assert set(model['variants']) == {'sweep', 'sweep_all', 'loop', 'loop_needed', 'attribution',
                                    'attribution_blocks', 'cache', 'cache_grads', 'by_hand',
                                    'grad', 'param_grad', 'forward'}
  for v, m in model['variants'].items():
    assert variant_keys <= set(m), (v, variant_keys - set(m))
    assert len(m['samples_s']) == 2 and m['median_s'] > 0 and m['compile_s'] > 0, v
    assert len(m['queued_samples_s']) == 2 and m['queued_median_s'] > 0, v
  # Timed twice: each call waited for (the targets), and calls queued back to back.
  assert set(model['ratios_queued']) == set(model['ratios'])
  assert all(r > 0 for r in model['ratios_queued'].values())
  assert set(model['ratios']) == {'loop_over_sweep', 'loop_over_sweep_all',
                                  'loop_needed_over_sweep', 'attribution_over_forward',
                                  'attribution_blocks_over_forward',
                                  'attribution_over_its_parts', 'attribution_blocks_over_by_hand',
                                  'by_hand_over_forward', 'grad_over_forward',
                                  'attribution_over_param_grad',
                                  'sweep_over_forward'}
  assert all(r > 0 for r in model['ratios'].values())
  assert len(model['targets_met']) == 2
  assert 'gpt2: OK' in stdout, stdout[-3000:]


def check_interventions_scan(stdout: str, data: dict):
  variant_keys = {'median_s', 'p25_s', 'p75_s', 'samples_s', 'lower_s', 'compile_s',
                  'temp_bytes'}
  assert data['benchmark'] == 'interventions_scan'
  assert data['config']['sizes'] == 'tiny' and data['config']['repeats'] == 2
  assert data['all_ok'] is True
  model = data['models']['transformer']
  # The script's own checks: every effect of the scanned model equals the unrolled model's
  # row for the same layer and call.
  assert model['checks'] == {'sweep_scan_vs_unrolled': True, 'attribution_scan_vs_unrolled': True,
                             'forward_scan_vs_unrolled': True}, model['mismatches']
  assert model['rows'] > model['size']['layers']
  assert set(model['variants']) == {'sweep_scan', 'sweep_unrolled', 'attribution_scan',
                                    'attribution_unrolled', 'forward_scan', 'forward_unrolled'}
  for v, m in model['variants'].items():
    assert variant_keys <= set(m), (v, variant_keys - set(m))
    assert len(m['samples_s']) == 2 and m['median_s'] > 0, v
  assert len(model['ratios']) == 5 and all(r > 0 for r in model['ratios'].values())
  assert 'transformer: OK' in stdout, stdout[-3000:]


RUNS = {
    'activation_grads': ('bench_activation_grads.py', ['--sizes', 'small', '--repeats', '2'],
                         check_activation_grads),
    'interleaved': ('bench_interleaved.py', ['--sizes', 'tiny', '--repeats', '2', '--models',
                                             'transformer'], check_interleaved),
    'interventions': ('bench_interventions.py', ['--sizes', 'tiny', '--repeats', '2'],
                      check_interventions),
    'interventions_scan': ('bench_interventions_scan.py', ['--sizes', 'tiny', '--repeats', '2'],
                           check_interventions_scan),
    'kfac': ('bench_kfac.py', ['--sizes', 'small', '--models', 'mlp', '--repeats', '2'],
             check_kfac),
    'per_example': ('bench_per_example.py', ['--sizes', 'tiny', '--models', 'mlp', 'cnn',
                                             '--repeats', '2'], check_per_example),
    'per_example_nnx': ('bench_per_example.py', ['--api', 'nnx', '--sizes', 'tiny', '--models',
                                                 'mlp', '--repeats', '2'],
                        functools.partial(check_per_example, api='nnx', models=('mlp',))),
    'real_models': ('bench_real_models.py', ['--quick', '--models', 'gpt2'], check_real_models),
}


def run_and_check(name: str, tmp_path):
  script, args, check = RUNS[name]
  stdout, data = _run(script, args, tmp_path / 'results' / f'{name}.json')
  check(stdout, data)


def _runs_class(name: str):
  """``TestBenchInterleaved``: a class per script run, so pytest-xdist (``--dist loadscope``)
  gives each run to whichever worker is free."""
  def test_runs_and_checks_pass(self, tmp_path):
    del self
    run_and_check(name, tmp_path)
  title = ''.join(part.title() for part in name.split('_'))
  return type(f'TestBench{title}', (), {'test_runs_and_checks_pass': test_runs_and_checks_pass,
                                         '__doc__': f'The {name} benchmark.'})


for _name in sorted(RUNS):
  _class = _runs_class(_name)
  globals()[_class.__name__] = _class
