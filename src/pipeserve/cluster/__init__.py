"""The cluster: machines that join a sharded model without ssh.

- `node.py`: the agent `pipeserve node` runs on each extra machine: it announces itself
  (discovery.py), reports its memory and MLX over a token-authenticated HTTP API and, on
  an assignment from the serving machine, starts pipeserve's own rank entry point
  (`pipeserve.engine.sharding.peer`) for its share, with the model files it fetched from
  the serving machine (files.py);
- `placement.py`: which layers (pipeline) or which slice (tensor) each machine holds,
  from each machine's usable memory, checked to fit;
- `launch.py`: rank 0's side: find the nodes, place, assign, watch (heartbeats), stop.

The lockstep engine and the rank math stay in `engine/sharding/`; this package only
decides where the ranks run and starts them there.
"""
