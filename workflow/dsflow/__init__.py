"""dsflow: declarative, reproducible DeepSeek-architecture training with DeepSpeed."""

__version__ = "0.1.0"
