"""The JAX program that runs on every host. It knows nothing of SSH or the TPU API."""
