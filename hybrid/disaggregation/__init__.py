"""Prefill-decode disaggregation: a sequence prefilled by one engine continues in another, its KV handed over."""
