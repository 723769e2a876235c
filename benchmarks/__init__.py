"""Benchmarks of lightning_gpuopt: ``python -m benchmarks.throughput`` (see ``benchmarks/README.md``)."""
