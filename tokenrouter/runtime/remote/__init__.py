"""Subservers the entry does not spawn itself: joined by hand from another host (joiner.py, met by
join_desk.py) or started as Ray actors (ray_actor.py), seen by the entry as a RemoteSubserver."""
