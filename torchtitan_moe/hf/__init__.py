"""Hugging Face Qwen3-MoE checkpoints in and out (convert.py), and what dropping an expert bias costs
(bias_cost.py)."""
