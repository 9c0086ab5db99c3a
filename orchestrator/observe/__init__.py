"""Seeing a live run: `tpuctl top` (top.py) and `tpuctl profile` (live_profile.py), both through the trainer
side's own commands run beside each host's trainer (live.py; hostwrap `beside`)."""
