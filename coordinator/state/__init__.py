"""The coordinator's state in Table Storage: the layout (``tables``), the one read-modify-write with ETags
(``commit``) and event records read with their VMs' sightings (``events``)."""
