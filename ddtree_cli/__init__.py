"""ddtree: patch, deploy, benchmark and diagnose DDTree speculative decoding on SGLang."""

__version__ = "0.1.0"
