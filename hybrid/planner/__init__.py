"""The planner: predicted TTFT / TPOT of a model on this machine before loading it (hybridd doctor, slo-report)."""
