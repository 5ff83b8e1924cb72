"""``ddtree doctor``: host facts in, verdicts (pass / warn / fail / skip + fix) out.

The facts come from :mod:`ddtree_cli.remote.facts`, one stdlib script that also runs on
remote hosts as a single file. Every rule is a pure function over them:

verdict.py         the one verdict type (doctor's checks, deploy's preflight rows)
parsing.py         version, tag and pin readings the rules share
snapshot_abi.py    what a snapshot needs from the interpreter (the one reader)
snapshot_rules.py  serving Python and sglang vs the snapshot; is DDTREE applied
cuda_rules.py      torch build, driver, GPU architecture, nvcc, CUDA wheels, persistence
kernel_rules.py    sgl_kernel / flashinfer / sglang imports and pins, attention backend
compatibility.py   the rule set doctor and deploy's preflight both run, in order
checkpoints.py     whether SGLang can feed the DFlash draft the target layers it reads
service_rules.py   the unit (state, journal, settings), its ports, /health, disk
process_rules.py   leftover sglang:: processes, told apart from live servers' children
fairness.py        what an A/B's hosts must share, and where they differ
report.py          every rule per host, many hosts in parallel, the --json report
"""
