"""Reaching a slice's workers: SSH config, keys, pinned host keys, proxies, OS Login, fabric."""
