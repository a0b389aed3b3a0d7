"""The errors of reading checkpoints and expert packs, in a module of their own so that the command line can name
them without importing torch (which `hybridd stop` and `status` never need)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and tensor."""


class PackError(ValueError):
    """A pack directory that is missing, incomplete, corrupt or made for something else."""
