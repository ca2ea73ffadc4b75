"""The coordinator's stages, each entered once per run, in order: ingest -> fold -> decide -> act (approvals, cards)
-> record; the timer and the people's routes are runs of their own that end in the same tail."""
