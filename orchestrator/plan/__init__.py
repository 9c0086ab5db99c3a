"""`tpuctl plan`: the TPU compiler's verdict on a trainer step, one slice or several."""
