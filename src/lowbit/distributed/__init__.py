"""Parallelism around the model: the device mesh, data-parallel gradient exchange (FP8 included) and context
(sequence) parallel attention. Applied to a built model and its training step; the model itself stays plain."""
