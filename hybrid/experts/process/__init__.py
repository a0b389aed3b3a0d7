"""The expert process: its server, the engine-side client and the shared-memory call slots between them."""
