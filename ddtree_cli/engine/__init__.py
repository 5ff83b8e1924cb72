"""The embedded engine: a small Qwen3-architecture target, a DFlash drafter laid out as
SGLang's ``DFlashDraftModel``, AR / DFlash / DDTree decoding over a batched KV cache, and an
HTTP server speaking the subset of SGLang's API that ``ddtree bench`` and ``deploy`` use.

Pure PyTorch (CPU and CUDA); importable without Typer/Rich so it runs on bare GPU hosts.
"""

from __future__ import annotations

ALGORITHMS = ("ar", "dflash", "ddtree")
