"""The coordinator's pure domain: records, the sighting and lifecycle rules, the policy and its controls, history rows
and cards. No I/O: nothing here reads a clock, a table or the network (the ``domain-pure`` import rule)."""
