"""The model: a Llama-family decoder and what reads or changes its weights.

``transformer`` (the Flax decoder, its KV cache and value head), ``fused_attention`` and
``splash`` (cuDNN's and Pallas TPU's attention kernels), ``logprobs`` (per-token log-probs
without a [B, T, V] array), ``packing`` (sequences laid end to end), ``lora`` (low-rank
adapters on a frozen base) and ``pretrained`` (GGUF / HF import and export). Imports the
root modules, ``parallel`` and ``text``.
"""
