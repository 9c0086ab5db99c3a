"""`python -m bench.tpu` (`make tpu-check`): the chip's own check of the trainer, in one process on a TPU host.

Sections (each a module here, each row measured on the chip in this run):
- kernels: the loss kernels and splash attention against f32 references, forward and gradients;
- classes: how fast the chip does each class of the plan's work (matmuls, splash at GPT-2's and Gemma's head_dim,
  the loss kernels, elementwise HBM traffic): the figures trainer/common/calibration.py keeps;
- steps: our gpt2-124m step beside the seed's (bench/seed_gpt2.py) at T 1024, batches 8, 16 and 32, with the
  plan's calibrated time for each;
- choices: every alternative of what an `auto` flag or default picks (loss kernel, attention, splash block,
  remat, loss chunk), beside what trainer/common/chip_choices.py picks;
- cli: a short `python -m trainer pretrain` with a checkpoint, and its resume, equal bit for bit to a run
  straight through;
- lora: a LoRA step of gemma2-2b and gemma3-1b from random bf16 weights;
- profile: a trace of two default steps, and its summary where xprof is installed (it is not on a TPU host by
  default: the trace is kept, and `python -m bench.tpu --summarize DIR` reads it elsewhere).

It prints one table (tok/s, MFU, step ms, the plan's ms, HBM, compile s) and writes the same as JSON. On a host
without a TPU it says so and exits 0; --cpu runs it on the CPU anyway (tiny sizes with --quick: the suite's check
that it runs). docs/tpu-check.md says how to run it on a TPU host without internet.
"""
