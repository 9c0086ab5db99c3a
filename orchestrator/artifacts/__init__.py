"""Kaggle artifacts (model weights, datasets) pulled once and staged in GCS."""
