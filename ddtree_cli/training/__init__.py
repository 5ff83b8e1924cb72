"""Train the embedded target + DFlash drafter pair on the Python standard library.

Not needed at run time; needs the engine extra (torch, safetensors) and numpy. One command
per stage, fixed seeds, each stage's outputs in files::

    python -m ddtree_cli.training corpus   --out corpus.npz
    python -m ddtree_cli.training target   --corpus corpus.npz --out model
    python -m ddtree_cli.training gendata  --corpus corpus.npz --model model --out data
    python -m ddtree_cli.training drafter  --data data --model model
    python -m ddtree_cli.training eval     --corpus corpus.npz --model model --out eval.json
    python -m ddtree_cli.training pipeline --corpus corpus.npz --out model  # 2-5 in one go
    # keep a trained target, redo 3-5:
    python -m ddtree_cli.training pipeline --corpus corpus.npz --out model --target-from DIR

Modules: corpus (stage 1 and the held-out rule), model_setup (sizes, seeds, device, model
folders), forwards (full-sequence forwards through the engine's modules), data (stage 3),
loop (stages 2 and 4), evaluation (stage 5), cli (the commands above).
"""
