"""Filters select exactly the expected points, whose gradients equal the hand twin's there."""
import re

import chex
import flax.linen as nn
import jax
import optax
import pytest

import models
import perturbkit
from perturbkit import filters

TOL = dict(rtol=1e-5, atol=1e-6)


def _grads(name, filter):
  case = models.CASES[name]
  x = jax.random.normal(jax.random.key(1), case.x_shape)
  variables = models.init(case, case.model, x)
  loss = models.loss_fn_for(case, case.model)
  key = jax.random.key(0)
  _, got = perturbkit.value_and_grad(loss, filter=filter, has_aux=True)(variables, x, key)
  # The twin perturbs a superset of the points here, and extra zero perturbations
  # change no gradient, so its values are the reference at every selected point.
  _, want = models.hand_value_and_grad(case, variables, x, key)
  return models.unnest(got['perturbations']), models.unnest(want['perturbations'])


SELECTIONS = [
    ('mlp', filters.by_path('Dense_1', 'Dense_2'), {'Dense_1/__call__', 'Dense_2/__call__'}),
    ('mlp', ['Dense_?'], {'Dense_0/__call__', 'Dense_1/__call__', 'Dense_2/__call__'}),
    ('mlp', filters.negate(filters.by_path('Dense_0')), {'Dense_1/__call__', 'Dense_2/__call__'}),
    ('transformer_eval', filters.by_type(nn.Dense), {'Dense_0/__call__', 'Dense_1/__call__'}),
    ('transformer_eval', filters.any_of(filters.by_type(nn.LayerNorm), filters.by_path('Dense_1')),
     {'LayerNorm_0/__call__', 'LayerNorm_1/__call__', 'Dense_1/__call__'}),
    ('remat', filters.top_level, {'Dense_0/__call__', 'block/__call__', 'Dense_1/__call__'}),
    ('remat', filters.by_depth(2, min_depth=2), {'block/Dense_0/__call__'}),
    ('setup_style', filters.by_method('encode', 'decode'), {'codec/encode', 'codec/decode'}),
    ('setup_style', filters.all_of(filters.by_path('codec/*'), filters.by_type(nn.Dense)),
     {'codec/inner/__call__', 'codec/outer/__call__'}),
    ('shared', filters.by_path('shared'), {'shared/__call__', 'shared/__call__#1'}),
]


@pytest.mark.parametrize('name, filter, expected', SELECTIONS)
def test_selects_expected_points_with_reference_values(name, filter, expected):
  got, want = _grads(name, filter)
  assert set(got) == expected
  chex.assert_trees_all_close(got, {k: want[k] for k in expected}, **TOL)


def test_filter_spellings():
  assert perturbkit.filters.as_filter(None) is filters.all_calls
  assert perturbkit.filters.as_filter(True) is filters.all_calls
  with pytest.raises(perturbkit.InvalidOptionError, match='None or True to select every call'):
    filters.as_filter(False)
  with pytest.raises(perturbkit.FilterError, match='path patterns'):
    filters.as_filter(3)
  with pytest.raises(perturbkit.FilterError, match='module classes'):
    filters.by_type('Dense')
  with pytest.raises(perturbkit.FilterError, match='string patterns'):
    filters.by_path(nn.Dense)
  with pytest.raises(perturbkit.InvalidOptionError, match='max_depth=0 .* a Python int >= 1'):
    filters.by_depth(0)
  with pytest.raises(perturbkit.InvalidOptionError, match='1 <= min_depth <= max_depth'):
    filters.by_depth(2, min_depth=3)


@pytest.mark.parametrize('regex', [r'^Dense_\d+$', r'^Dense_0$|^block$', r'^block/Dense_\d'])
def test_a_path_written_as_a_regular_expression_is_refused_with_the_pattern_that_works(regex):
  """``by_path`` takes shell-style patterns: a regular expression would select no call. The
  error's suggestion, run, selects the calls whose paths the regular expression matches
  (``re.fullmatch``, or ``re.match`` without ``$``) on a model with a nested Dense."""
  for given in (lambda: filters.by_path(regex), lambda: filters.as_filter([regex])):
    with pytest.raises(perturbkit.PathPatternError, match='regular expression') as error:
      given()
    assert isinstance(error.value, perturbkit.FilterError) and isinstance(error.value, ValueError)
  suggestion = str(error.value).split('Write it as ')[1].split(' (`*`')[0].removesuffix('.')
  if not suggestion.startswith('filters.'):
    suggestion = f'filters.by_path({suggestion})'
  suggested = eval(suggestion, {'filters': filters})
  got, _ = _grads('remat', suggested)
  paths = ['Dense_0', 'block', 'block/Dense_0', 'Dense_1']
  match = re.fullmatch if regex.endswith('$') else re.match
  assert {p.rsplit('/', 1)[0] for p in got} == {p for p in paths if match(regex, p)}


def test_a_module_class_or_a_bad_combinator_argument_is_refused_where_given():
  """``filter=nn.Dense`` (for ``by_type(nn.Dense)``) would build a module when called as a
  filter: Flax then either renames the model's own layers or raises deep inside. Refused, as
  are combinators of things that are no filters and method names that are no strings; the
  fix (``by_type``) selects the Dense calls alone."""
  with pytest.raises(perturbkit.FilterError, match=r'filters\.by_type\(Dense\)'):
    filters.as_filter(nn.Dense)
  with pytest.raises(perturbkit.FilterError, match=r'filters\.by_type\(Dense\)'):
    perturbkit.value_and_grad(lambda v, x: 0.0, filter=nn.Dense)
  for combine in (filters.all_of, filters.any_of, filters.negate):
    with pytest.raises(perturbkit.FilterError, match=r'filters\.(all_of|any_of|negate) takes call'):
      combine('Dense_0')
  with pytest.raises(perturbkit.FilterError, match='filters.all_of takes call filters'):
    filters.all_of(filters.top_level, nn.Dense)
  with pytest.raises(perturbkit.FilterError, match='one or more method names'):
    filters.by_method(['__call__'])
  with pytest.raises(perturbkit.FilterError, match='one or more method names'):
    filters.by_method()
  got, want = _grads('transformer_eval', filters.by_type(nn.Dense))
  assert set(got) == {'Dense_0/__call__', 'Dense_1/__call__'}


def test_a_module_or_a_function_of_other_arguments_is_refused_where_given():
  """A filter of one argument failed with Python's TypeError when the step ran, and a module
  given as a filter (``filter=nn.Dense(3)``) failed deep inside Flax; both are refused where
  given, for every option that takes a call filter."""
  one_argument = lambda module: True
  for bad, match in ((one_argument, r'two arguments \(module, method_name\).*takes \(module\)'),
                     (nn.Dense(3), r'not a module.*filters\.by_type\(Dense\)')):
    with pytest.raises(perturbkit.FilterError, match=match):
      perturbkit.value_and_grad(lambda v, x: 0.0, filter=bad)
    with pytest.raises(perturbkit.FilterError, match=match):
      perturbkit.backward_hook(lambda g: g, bad)
    with pytest.raises(perturbkit.FilterError, match=match):
      filters.negate(bad)
    with pytest.raises(perturbkit.FilterError, match='segments= .*' + match):
      perturbkit.interleaved(lambda v, x: 0.0, optax.sgd(0.1), segments=bad)
  assert filters.as_filter(lambda *a: True)(None, '__call__')


def test_the_filters_import_as_a_module_on_both_front_ends():
  """``from perturbkit.filters import by_path`` works as ``from perturbkit import filters``
  does (it was a ModuleNotFoundError), and the NNX names are the same functions."""
  import importlib
  linen_face = importlib.import_module('perturbkit.filters')
  nnx_face = importlib.import_module('perturbkit.nnx.filters')
  assert linen_face is perturbkit.filters
  assert linen_face.__all__ == nnx_face.__all__
  for name in linen_face.__all__:
    assert getattr(linen_face, name) is getattr(nnx_face, name), name


def test_a_filter_answering_with_a_traced_value_is_a_named_error():
  """A filter whose answer depends on an array (one closed over under jax.jit, a param it
  reads, even ``jnp.array(True)`` made while tracing) raised JAX's TracerBoolConversionError
  from inside the interceptor, for every option that takes a call filter."""
  from flax import nnx
  import jax.numpy as jnp
  model = nn.Sequential([nn.Dense(2), nn.relu, nn.Dense(1)])
  x = jnp.ones((2, 3))
  variables = model.init(jax.random.key(0), x)
  loss = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
  match = 'answered with a value traced by JAX.*decide from the module and the method name alone'
  on = lambda t: lambda module, method_name: t > 0
  uses = [
      lambda t: perturbkit.value_and_grad(loss, filter=on(t))(variables, x),
      lambda t: perturbkit.run_with_cache(model.apply, filter=on(t))(variables, x),
      lambda t: jax.grad(perturbkit.with_hooks(
          loss, perturbkit.backward_hook(lambda g: g, on(t))))(variables, x),
      lambda t: perturbkit.interleaved(loss, optax.sgd(0.1), segments=on(t)).init(variables, x),
  ]
  for use in uses:
    with pytest.raises(perturbkit.FilterError, match=match):
      jax.jit(use)(1.0)
  with pytest.raises(perturbkit.TracedFilterError, match='__call__ call of a Dense'):
    perturbkit.value_and_grad(loss, filter=lambda m, n: jnp.array(True))(variables, x)
  stack = nnx.Sequential(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
  reads_kernel = lambda m, n: m.kernel[...].sum() > 0
  with pytest.raises(perturbkit.TracedFilterError, match='__call__ call of a Linear'):
    perturbkit.nnx.run_with_cache(lambda m, x: m(x), filter=reads_kernel)(stack, x)
