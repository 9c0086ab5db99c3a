"""What the TPU compiler counts for a step, without a chip: steps compiled ahead of time by libtpu on this machine
(the `plan` extra) for a TPU topology: per-device bytes, temporaries, FLOPs and the roofline, ours beside the
seed's and MaxText's."""
