"""The server subprocess helpers live in the package (tokenrouter.bench.server_process)."""

from tokenrouter.bench.server_process import ServerProcess, alive, children, free_port

__all__ = ["ServerProcess", "alive", "children", "free_port"]
