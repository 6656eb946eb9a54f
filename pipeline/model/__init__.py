"""The model layer: families, loading (qlora / lora / full), tiny offline models, hardware, planning, training.

Submodules import torch / transformers lazily where they can; import what you need from them directly.
"""
