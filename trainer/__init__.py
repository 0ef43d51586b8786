"""The trainer (issue 7): DDP fine-tuning on the exported shards."""
