"""Data layer: tokenizers, pretraining shards, SFT and preference datasets."""
