"""Quality and cost of routing: held-out evaluation and the query-level baseline."""
