"""Training data: reading JSONL, Parquet and datasets directories with row-level errors, chat rendering,
tokenising SFT demonstrations, preference pairs and prompts, and the batch streams the trainers draw from.
"""
