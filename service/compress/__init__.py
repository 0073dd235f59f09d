"""Compression: quantize (INT8/INT4 RTN or GPTQ, FP8) and prune (magnitude, Wanda, 2:4) a checkpoint into
the compressed-tensors form vLLM loads natively; ``loading`` reads those checkpoints back on CPU.

Open ``pipeline.py`` first: it is one run from source checkpoint to output directory.
"""
