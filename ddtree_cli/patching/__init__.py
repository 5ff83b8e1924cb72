"""Add DDTREE to an SGLang source snapshot: detect, check, apply, revert, export, fetch."""
