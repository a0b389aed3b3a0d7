"""The daemon processes and their wiring: supervisor, engine server, the api side of the engine, typed messages."""
