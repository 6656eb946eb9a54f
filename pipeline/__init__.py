"""tamis: data-centric active learning for vision-language models (the library; no Prefect here)."""

__version__ = "0.1.0"
