"""tpuctl: the user's side. `up`, `run` and `down` a Cloud TPU slice (or a local stand-in of one)."""
