"""`python -m bench`: side-by-side speed of our trainer vs the seed GPT-2 trainer in bench/seed_gpt2.py (see bench/__main__.py)."""
