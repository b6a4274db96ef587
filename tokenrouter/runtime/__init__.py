"""The multi-model runtime: one subserver process per model, the entry that admits requests and
reassembles their tokens, the messages between them, and the group config that describes them."""
