"""`python -m bench`: side-by-side speed of our trainer vs the seed article's GPT-2 (see bench/__main__.py)."""
