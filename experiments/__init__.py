"""Entry points that turn a configuration into results (JSON, CSV, markdown, PNG).

``experiments.actfirst_alfworld`` reproduces the ActFirst-OPD rollout-speedup experiment (paper Section 5.4,
Fig. 3a,b, App. C.5); its parts: ``speedup_protocol`` (paired Vanilla / ActFirst drivers over an engine),
``idealized`` (Proposition 1 and App. A.2 bounds), ``alfworld_contexts`` (the initial contexts),
``report`` (output files); the virtual-clock engine of the tests is ``jaxopd.sampler.simulated``.
"""
