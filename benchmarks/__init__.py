"""Benchmarks of routed (MoD/SDT/STT) against dense Qwen2.5 models: FLOPs, prefill, training, decode.

Entry point: ``python -m benchmarks.run --help`` (see ``benchmarks/README.md``).
"""
