"""What runs in a subserver's process: one model's engine behind its sockets (subserver.py), the
process it runs in (process.py), and the ways it is started other than by the entry: joined by hand
from another host (joiner.py) or as a Ray actor (ray_actor.py). Nothing here imports the entry's side;
the two sides share only the contract one folder up (messages, group config, model identity,
transport security, connection watch)."""
