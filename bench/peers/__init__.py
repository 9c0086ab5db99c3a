"""How our step compares with another implementation of the same work, timed on this machine's CPU, the
contenders alternated in the same run: the seed's trainer (bench/seed_gpt2.py), tunix's LoRA step, decoding
without a KV cache, our step with one thing changed. Read the ratios, not the values."""
