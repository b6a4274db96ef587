"""The multi-model runtime: one subserver process per model, the entry that admits requests and
reassembles their tokens, the messages between them, and the group config that describes them.
Cut by the process a file runs in: entry/ (the entry's process) and subserver/ (each subserver's);
what both import, the contract between them, stays here."""
