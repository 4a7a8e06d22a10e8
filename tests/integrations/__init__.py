"""Tests on real third-party code: transformers, lightning, peft, trl, diffusers, coverage."""
