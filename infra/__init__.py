"""The cloud's side: host bootstrap and local stand-ins of the Cloud TPU API, GCS and Kaggle."""
