"""Ablation plans, the input of `splicer ablate`: the TOML files and their rows (`plan`), how a plan's rows spread over
several GPUs (`spread`), and `splicer plan sweep`, which writes a plan restoring a class in groups of layers (`sweep`).
"""
