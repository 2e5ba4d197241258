"""Learned gates: differentiable top-k relaxations (``topk``) for per-(layer, head) soft keep-masks."""
