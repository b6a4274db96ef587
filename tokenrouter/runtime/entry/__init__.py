"""What runs in the entry's process: the Entry (entry.py) and the parts it composes: the subserver
processes and their sockets (subserver_pool.py), admission and KV reservation, reassembly, placement,
the launch planner, load adaptation, and the entry's side of the subservers it does not spawn (the
join desk, Ray actors' handles). It starts subservers (subserver.process, subserver.ray_actor) but
shares with them only the contract one folder up (messages, group config, model identity, transport
security, connection watch)."""
