"""Model definitions (Flax NNX). gpt2: the GPT-2 family behind the gpt2-* presets."""
