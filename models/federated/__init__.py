"""Federated fine-tuning of a bundle on Flower: strategies, the site trainer, the apps and the
processes that run them (docs/federated.md)."""
