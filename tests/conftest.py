"""Strict JAX for every test: rank promotion is an error, not a silent broadcast."""
import jax

jax.config.update('jax_numpy_rank_promotion', 'raise')
