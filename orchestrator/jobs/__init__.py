"""A job's life on a slice: the bundle, launch, run, supervise across preemptions, sweeps."""
