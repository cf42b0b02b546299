"""Where a run executes: one Strategy per backend (single process, torchrun DDP/FSDP2, DeepSpeed) that wraps
models, builds the optimiser and saves sharded state; torch.distributed helpers; the bf16 precision probe
and CPU thread settings. Only this wing touches torch.distributed.
"""
