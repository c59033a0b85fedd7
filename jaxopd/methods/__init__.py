"""What a training run is made of beyond the trainer: benchmark task sources and supervised fine-tuning data."""
