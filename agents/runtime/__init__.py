"""The reference worker runtime: a small MoE transformer in PyTorch, its weights and its tokenizer.

This package holds the model itself (functional layers that take sharded weights, so a distributed rank
and the single-process oracle run the same code) and the oracle. The distributed ranks, the node agent
and serving come on top of it.
"""
