"""Models and their files: loading HF causal LMs and tokenizers with checks, the scalar-head reward and value
models, the bag-of-tokens reward model, LoRA adapters and merging policies (model soups).
"""
