"""Turning a checkpoint into a runnable model: build it from the registry, pack its dense weights, load the rest."""
