"""Probes of pretrained models on the project's agent protocol (no training): ``zero_shot``."""
