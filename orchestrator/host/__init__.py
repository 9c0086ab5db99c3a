"""What runs on the slice's hosts themselves: bootstrap.sh (the environment), hostwrap.py (one run's process,
its log, secrets and stop), hostprobe.py (preflight). Standard library and POSIX shell only: a fresh TPU VM
has nothing else. They are pushed as files (orchestrator/access/hosts.py), never imported there from the bundle."""
