"""The error of a command line that cannot run."""


class UsageError(ValueError):
    """A command line that cannot run although every value parsed (exit code 2, as the C++ command's): an unknown
    layer or preset, --parallel without torchrun, a batch that does not split over the processes."""
