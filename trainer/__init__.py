"""The trainer: DDP fine-tuning on the exported shards."""
