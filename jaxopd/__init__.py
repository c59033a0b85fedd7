"""jaxopd: pure-JAX on-policy distillation of multi-turn language agents."""
