"""Serving what the rounds trained, beyond tamis: the standalone predict.py an export carries, which runtimes can take
a family's model (`tamis export-model --check`), and the vLLM hand-off (`--format vllm`). docs/use-your-model.md."""
