"""Run directories and what is written into them: checkpoints (the one writer of every backend's training state
and of final/, best/), run-directory locks, metrics tables and the trackers (JSONL, TensorBoard, W&B,
MLflow).
"""
