"""The engine: requests in, tokens out. Scheduler, sequences, sampler, detokenizer and the model runner."""
