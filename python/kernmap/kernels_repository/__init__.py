"""kernmap as a local kernel repository of the Hugging Face `kernels` library: `kernels` imports this file and
reads its `layers` (see kernmap.layers)."""

from kernmap import layers  # noqa: F401
