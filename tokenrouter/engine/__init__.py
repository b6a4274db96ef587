"""The single-model engine: requests, the scheduler with its paged KV and radix prefix cache, the model
runner and sampler, and `Engine`, which drives them. No I/O: the offline API, the subservers and the
tests share it."""
