"""Colocation: where the trainers and the rollout engines share GPUs, they take turns holding
device memory. One module per job; import from the module:

    checks.py        the ``colocation`` section's problems (``COMPONENT_CHECKS``)
    plan.py          who is managed, in which order the roles start, what stays resident
                     beside the engines (``ColocationPlan``, ``plan_colocation``)
    choreography.py  the phases of a step and the transitions into them (``Choreography``),
                     the trace and the memory figures

The parity check for colocated roles is the sync's: ``roll_ds/weight_sync/parity.py``
(``colocated_parity``). Nothing here imports torch or Ray: validation imports ``checks.py``.
"""
