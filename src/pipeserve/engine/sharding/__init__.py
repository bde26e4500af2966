"""Sharded generation: one model across several processes (and machines) over mx.distributed.

Rank 0 is the gunicorn worker's engine thread; it starts the other ranks (group.py),
every rank loads only its share of the weights (load.py: tensor via mlx-lm's
`Model.shard`, pipeline via mlx-lm's `pipeline()` or pipeserve's layer-range adapter in
pipeline.py), and the ranks run the same BatchGenerator in lockstep: rank 0 decides every
change to the batch and sends it to the others before the step that uses it
(lockstep.py, over the control channel of control.py). Activations and all-reduces travel
over mx.distributed only; the control channel carries the batch log, nothing else.
"""
