"""value_and_grad on 8 host CPU devices (shard_map and sharded jit) equals one device.

XLA_FLAGS must be set before jax is imported, so the check runs in a child process.
"""
import textwrap

from host_devices import run_child

CHILD = textwrap.dedent('''
    import os
    os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
    import sys
    import chex, jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update('jax_numpy_rank_promotion', 'raise')
    sys.path.insert(0, sys.argv[1])
    import models
    import perturbkit
    assert jax.device_count() == 8, jax.devices()

    model = models.MLP()
    x = jax.random.normal(jax.random.key(1), (16, 5))
    variables = model.init(jax.random.key(0), x)
    loss_fn = lambda v, x: models.scalar(model.apply(v, x))
    vg = perturbkit.value_and_grad(loss_fn)
    single_loss, single = jax.jit(vg)(variables, x)

    # The hand twin, as an independent reference for the single-device result.
    zeros = models.MLP(hand=True).init(jax.random.key(0), x)['perturbations']
    hand = jax.grad(lambda eps: models.scalar(models.MLP(hand=True).apply(
        {**variables, 'perturbations': eps}, x)))(zeros)
    chex.assert_trees_all_close(single['perturbations'], models.nest(hand), rtol=1e-5, atol=1e-6)

    mesh = Mesh(jax.devices(), ('data',))

    def local(v, x):
      loss, grads = vg(v, x)
      # Each device's loss is its shard's sum: params grads add up, points stay sharded.
      return (jax.lax.psum(loss, 'data'),
              {'params': jax.lax.psum(grads['params'], 'data'),
               'perturbations': grads['perturbations']})

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P('data')),
                                    out_specs=(P(), {'params': P(), 'perturbations': P('data')}),
                                    check_vma=False))
    loss8, grads8 = sharded(variables, x)
    chex.assert_trees_all_close(loss8, single_loss, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(grads8, single, rtol=1e-5, atol=1e-5)

    # Sharded jit: the batch split over the devices, the computation the same.
    x_sharded = jax.device_put(x, NamedSharding(mesh, P('data')))
    loss_j, grads_j = jax.jit(vg)(variables, x_sharded)
    chex.assert_trees_all_close((loss_j, grads_j), (single_loss, single), rtol=1e-5, atol=1e-5)
    assert len(x_sharded.sharding.device_set) == 8
    print('MULTIDEVICE-GRADS-OK')
''')


def test_sharded_value_and_grad_equals_single_device():
  run_child(CHILD, 'MULTIDEVICE-GRADS-OK')


MODEL_PARALLEL = textwrap.dedent(r'''
    import os
    os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=8'
    import re, sys
    import chex, flax.linen as nn, jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, sys.argv[1])
    import perturbkit

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'model'))
    TOL = dict(rtol=1e-5, atol=1e-6)

    def collectives(compiled):
      text = compiled.as_text()
      return {op: text.count(f' {op}(') + text.count(f' {op}-start(') for op in collectives.OPS}

    collectives.OPS = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute',
                       'all-to-all')

    # Linen: Megatron-style column- then row-parallel Dense, batch over 'data'.
    split = lambda axes: nn.with_partitioning(nn.initializers.lecun_normal(), axes)

    class MLP(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = nn.relu(nn.Dense(64, kernel_init=split((None, 'model')))(x))
        h = nn.LayerNorm()(nn.Dense(32, kernel_init=split(('model', None)))(h))
        return nn.Dense(8)(h)

    model = MLP()
    x = jax.random.normal(jax.random.key(1), (16, 32))
    boxed = model.init(jax.random.key(0), x)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), nn.get_partition_spec(boxed))
    variables = jax.device_put(nn.unbox(boxed), shardings)
    xs = jax.device_put(x, NamedSharding(mesh, P('data')))
    loss_fn = lambda v, x: jnp.mean(model.apply(v, x) ** 2)
    plain = jax.jit(jax.value_and_grad(loss_fn)).lower(variables, xs).compile()
    ours = jax.jit(perturbkit.value_and_grad(loss_fn)).lower(variables, xs).compile()
    assert collectives(ours) == collectives(plain), (collectives(ours), collectives(plain))
    assert collectives(plain)['all-reduce'] > 0
    (loss, grads), (want_loss, want) = ours(variables, xs), plain(variables, xs)
    chex.assert_trees_all_close((loss, grads['params']), (want_loss, want['params']), **TOL)
    hidden = grads['perturbations']['Dense_0']['__call__']
    assert hidden.sharding.spec == P('data', 'model'), hidden.sharding
    single = perturbkit.value_and_grad(loss_fn)(jax.device_get(variables), x)
    chex.assert_trees_all_close((loss, grads), single, **TOL)

    # The interleaved step ('original': exactly jax.grad + optax) communicates what the
    # standard step does, plus scalars (its metrics), nothing of an activation's size.
    def sent_bytes(compiled):
      total = 0
      for line in compiled.as_text().splitlines():
        head = line.split('=', 1)[-1]
        if any(f' {op}(' in head or f' {op}-start(' in head for op in collectives.OPS):
          for dims in re.findall(r'f32\[([0-9,]*)\]', head.split('(')[0]):
            total += 4 * int(np.prod([int(d) for d in dims.split(',') if d]))
      return total

    tx = optax.adam(1e-2)
    def standard(params, opt_state, x):
      g = jax.grad(lambda p: loss_fn({'params': p}, x))(params)
      updates, opt_state = tx.update(g, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    interleaved = perturbkit.interleaved(loss_fn, tx, propagate='original')
    state = interleaved.init(variables, xs)
    step = jax.jit(interleaved.step).lower(state, xs).compile()
    standard = jax.jit(standard).lower(variables['params'], tx.init(variables['params']), xs)
    standard = standard.compile()
    assert collectives(step)['all-gather'] == collectives(standard)['all-gather'] == 0
    smallest_activation = 4 * 8 * 32
    assert sent_bytes(step) - sent_bytes(standard) < smallest_activation, (
        sent_bytes(step), sent_bytes(standard))
    new_state, _ = step(state, xs)
    want = standard(variables['params'], tx.init(variables['params']), xs)[0]
    chex.assert_trees_all_close(new_state.params, want, **TOL)
    assert new_state.params['Dense_0']['kernel'].sharding.spec == P(None, 'model')

    # NNX: the same layers, state sharded by its partition specs, jitted on nnx.split.
    class NNXMLP(nnx.Module):
      def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(32, 64, kernel_init=nnx.with_partitioning(init, (None, 'model')),
                             rngs=rngs)
        self.down = nnx.Linear(64, 32, kernel_init=nnx.with_partitioning(init, ('model', None)),
                               rngs=rngs)
        self.head = nnx.Linear(32, 8, rngs=rngs)
      def __call__(self, x):
        return self.head(self.down(nnx.relu(self.up(x))))

    with jax.set_mesh(mesh):  # NNX shards the variables where it creates them
      net = NNXMLP(nnx.Rngs(0))
    graphdef, state = nnx.split(net)
    assert state['up']['kernel'][...].sharding.spec == P(None, 'model')
    nnx_loss = lambda m, x: jnp.mean(m(x) ** 2)
    plain = jax.jit(lambda s, x: nnx.value_and_grad(nnx_loss)(nnx.merge(graphdef, s), x))
    ours = jax.jit(lambda s, x: perturbkit.nnx.value_and_grad(nnx_loss)(nnx.merge(graphdef, s), x))
    plain, ours = plain.lower(state, xs).compile(), ours.lower(state, xs).compile()
    assert collectives(ours) == collectives(plain), (collectives(ours), collectives(plain))
    (loss, grads), (want_loss, want) = ours(state, xs), plain(state, xs)
    chex.assert_trees_all_close((loss, grads['params']), (want_loss, want), **TOL)
    assert grads['perturbations']['up']['__call__'].sharding.spec == P('data', 'model')
    print('MODEL-PARALLEL-OK')
''')


def test_model_parallel_sharding_adds_no_communication():
  """Params sharded Megatron-style over a 'model' axis and the batch over 'data' (2 x 4 host
  devices), under sharded jit: activation gradients add no collective to the compiled program
  of ``jax.value_and_grad`` / ``nnx.value_and_grad``, the params' gradients equal theirs, the
  whole result equals one device, and the gradient at a column-parallel layer stays sharded
  like its output (Linen and NNX). The interleaved step sends nothing of an activation's size
  beyond the standard optax step's and equals it."""
  run_child(MODEL_PARALLEL, 'MODEL-PARALLEL-OK')
