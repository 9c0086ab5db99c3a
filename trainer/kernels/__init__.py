"""Pallas TPU kernels, each with its own check against a plain-jnp reference in tests/ (interpreted on CPU) and on
the chip (`python -m bench.tpu`, its kernels section). The models choose among them in trainer/models/."""
