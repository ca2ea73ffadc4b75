"""The coordinator's state: what the stages read and write (``store``: the ``StateStore`` protocol), how records
are laid out as entities (``entities``), the store in Table Storage (``tables``), the one read-modify-write with
ETags (``commit``) and event records read with their VMs' sightings (``events``)."""
