"""The policy tools: check a policy, run its test cases, replay the history through it (``python -m
ops.policy``). Pure decision code stays in coordinator/domain/ (policy, matching, evaluation, deletes); these
modules only build its inputs (``adapters``), read test cases (``cases``) and history (``exports``, ``replay``), and
print (``__main__``)."""
