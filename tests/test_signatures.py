"""The functions perturbkit makes from a user's function report their own arguments.

``inspect.signature`` (``help``, a notebook's tooltip, argument binding in
``flax.nnx.vmap``) reads a returned function's parameters; one that takes other
arguments than the user's function (a corrupted input, edits, a key) must not
report the user's ``(model, x)``. Each keeps the user's function's name.
"""
import inspect

import jax.numpy as jnp
import pytest

import perturbkit
from perturbkit import interpret


def metric(model, x):
  return jnp.mean(x)


STEER = {'steer': interpret.steering_vector('Dense_0/__call__', (2,))}
MADE = {
    'activation_patching': (lambda api: api.activation_patching(metric),
                            ['clean', 'corrupted']),
    'attribution_patching': (lambda api: api.attribution_patching(metric),
                             ['clean', 'corrupted']),
    'layer_integrated_gradients': (lambda api: api.layer_integrated_gradients(metric),
                                   ['inputs', 'baseline']),
    'run_with_edits': (lambda api: api.run_with_edits(metric), ['edits', 'args', 'kwargs']),
    'run_with_interventions': (lambda api: api.run_with_interventions(metric, STEER),
                               ['params', 'args', 'kwargs']),
    'private_grad': (lambda api: api.private_grad(metric, clip_norm=1.0, noise_multiplier=1.0),
                     ['key', 'args', 'kwargs']),
}


@pytest.mark.parametrize('api', [perturbkit, perturbkit.nnx], ids=['linen', 'nnx'])
@pytest.mark.parametrize('name', sorted(MADE))
def test_made_functions_report_their_own_arguments_and_the_users_name(api, name):
  make, after_model = MADE[name]
  made = make(api)
  assert list(inspect.signature(made).parameters)[1:] == after_model
  assert made.__name__ == 'metric'


def test_functions_with_the_users_arguments_keep_the_users_signature():
  """``value_and_grad`` and ``run_with_cache`` take what the user's function takes."""
  for made in (perturbkit.value_and_grad(metric), perturbkit.run_with_cache(metric)):
    assert list(inspect.signature(made).parameters) == ['model', 'x']
