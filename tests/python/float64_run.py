"""Runs a script (python float64_run.py SCRIPT ARGS...) with every layer mapped to its float64 kernel: kernelize
in the script binds them. tests/python/test_training_examples.py's noise run, as align's (docs/training.md, "The
verdict")."""

import runpy
import sys

import kernmap
from kernmap.train.models import float64_kernel, registered_layers

if __name__ == "__main__":
    mapping = {layer: {"cpu": float64_kernel(layer)} for layer in registered_layers() if float64_kernel(layer)}
    sys.argv = sys.argv[1:]
    with kernmap.use_mapping(mapping):
        runpy.run_path(sys.argv[0], run_name="__main__")
